"""paged_attention and write_kv against a dense per-request reference."""

from __future__ import annotations

import pytest
import torch

from ferrollm.attention.backend import AttentionMetadata, allocate_kv_cache, kv_cache_bytes_per_block
from ferrollm.attention.cpu_backend import paged_attention, write_kv
from ferrollm.exceptions import ConfigError
from helpers.paged_cases import CASES, build_case, dense_reference

torch.set_num_threads(2)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
def test_matches_dense_reference(case, heads):
    specs = CASES[case]
    num_heads, num_kv_heads = heads
    query, k, v, cache, step, dense = build_case(specs, 4, num_heads, num_kv_heads, 8, torch.float32, 0)
    meta = AttentionMetadata.from_step(step, block_size=4)
    write_kv(k, v, cache, meta.slot_mapping)
    out = paged_attention(query, cache, meta, scale=8**-0.5)
    ref = dense_reference(query, dense, specs, 8**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window,cap", [(3, None), (None, 5.0), (6, 2.0)])
def test_sliding_window_and_soft_cap(window, cap):
    specs = CASES["mixed"] + CASES["chunk_mid_block"]
    query, k, v, cache, step, dense = build_case(specs, 4, 4, 2, 8, torch.float32, 1)
    meta = AttentionMetadata.from_step(step, block_size=4)
    write_kv(k, v, cache, meta.slot_mapping)
    out = paged_attention(query, cache, meta, scale=0.3, sliding_window=window, logits_soft_cap=cap)
    ref = dense_reference(query, dense, specs, 0.3, window, cap)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)


def test_bfloat16_cache_accumulates_in_float32():
    specs = CASES["mixed"]
    query, k, v, cache, step, dense = build_case(specs, 16, 4, 2, 16, torch.bfloat16, 2)
    meta = AttentionMetadata.from_step(step, block_size=16)
    write_kv(k, v, cache, meta.slot_mapping)
    out = paged_attention(query, cache, meta, scale=0.25)
    assert out.dtype == torch.bfloat16
    ref = dense_reference(query, dense, specs, 0.25)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)


def test_metadata_wraps_step_arrays_without_copying():
    _, _, _, _, step, _ = build_case(CASES["mixed"], 4, 4, 2, 8, torch.float32, 3)
    meta = AttentionMetadata.from_step(step, block_size=4)
    assert meta.slot_mapping.data_ptr() == step.slot_mapping.ctypes.data
    assert meta.block_tables.data_ptr() == step.block_tables.ctypes.data
    assert (meta.num_reqs, meta.num_tokens, meta.max_query_len, meta.max_seq_len) == (5, 20, 12, 41)
    assert not meta.is_decode_only


def test_kv_cache_shape_and_size():
    caches = allocate_kv_cache(3, 10, 16, 2, 64, torch.bfloat16)
    assert len(caches) == 3 and caches[0].shape == (2, 10, 16, 2, 64)
    assert kv_cache_bytes_per_block(3, 16, 2, 64, torch.bfloat16) == 3 * caches[0][:, :1].numel() * 2
    with pytest.raises(ConfigError, match="num_blocks"):
        allocate_kv_cache(1, 0, 16, 2, 64, torch.float32)
