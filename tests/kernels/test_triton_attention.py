"""The Triton cache-write and paged-attention kernels, run by Triton's interpreter on the CPU,
against their torch references (the CPU backend) and the dense float64 reference."""

from __future__ import annotations

import helpers.triton_interpret  # noqa: F401  (must come before ferrollm.kernels.triton)
import pytest
import torch
from helpers.paged_cases import CASES, build_case, dense_reference

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.kernels.triton import (
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_prefill,
    paged_attention_prefill_ref,
    reshape_and_cache,
    reshape_and_cache_ref,
)

torch.set_num_threads(1)

# bf16 inputs: scores and the softmax are float32 in both, but the kernel rounds the softmax
# weights to bf16 before the PV product, as flash attention does.
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# Small tiles, so the cases cross tile and block boundaries.
TILES = dict(block_n=16)


def prepared(specs, heads, dtype, block_size=16, head_dim=8, seed=0):
    """A case with its new keys and values already written, and its metadata."""
    num_heads, num_kv_heads = heads
    query, k, v, cache, step, dense = build_case(specs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed)
    meta = AttentionMetadata.from_step(step, block_size)
    reshape_and_cache_ref(k, v, cache, meta.slot_mapping)
    return query, cache, meta, dense


def run_kernel(query, cache, meta, scale, window=None, cap=None):
    if meta.is_decode_only:
        return paged_attention_decode(query, cache, meta.block_tables, meta.seq_lens, scale, window, cap, **TILES)
    return paged_attention_prefill(query, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                   meta.max_query_len, scale, window, cap, block_m=16, **TILES)


def run_reference(query, cache, meta, scale, window=None, cap=None):
    if meta.is_decode_only:
        return paged_attention_decode_ref(query, cache, meta.block_tables, meta.seq_lens, scale, window, cap)
    return paged_attention_prefill_ref(query, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                       meta.max_query_len, scale, window, cap)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_slots_and_skips_negative_ones(dtype):
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, 16, 2, 24, generator=gen).to(dtype)
    key = torch.randn(7, 2, 24, generator=gen)  # float32 in, cast to the cache dtype
    value = torch.randn(7, 2, 24, generator=gen)
    slots = torch.tensor([17, 18, -1, 95, 0, -1, 40])
    expected = cache.clone()
    reshape_and_cache_ref(key, value, expected, slots)
    reshape_and_cache(key, value, cache, slots)
    assert torch.equal(cache, expected)
    assert torch.equal(cache[0, 1, 1], key[0].to(dtype))  # slot 17 = block 1, offset 1
    assert torch.equal(cache[1, 5, 15], value[3].to(dtype))  # slot 95 = block 5, offset 15


def test_reshape_and_cache_reads_strided_key_and_value():
    # Keys and values are column slices of one fused qkv projection.
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(5, (4 + 2 + 2) * 16, generator=gen)
    key = qkv[:, 64:96].view(5, 2, 16)
    value = qkv[:, 96:].view(5, 2, 16)
    cache, expected = torch.zeros(2, 4, 16, 2, 16), torch.zeros(2, 4, 16, 2, 16)
    slots = torch.tensor([3, 4, 20, 33, 63])
    reshape_and_cache(key, value, cache, slots)
    reshape_and_cache_ref(key, value, expected, slots)
    assert torch.equal(cache, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_cpu_backend_and_dense_reference(case, heads, dtype):
    specs = CASES[case]
    query, cache, meta, dense = prepared(specs, heads, dtype)
    out = run_kernel(query, cache, meta, scale=8**-0.5)
    assert out.dtype == dtype
    torch.testing.assert_close(out, run_reference(query, cache, meta, 8**-0.5), **TOL[dtype])
    dense_tol = TOL[dtype] if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.double(), dense_reference(query, dense, specs, 8**-0.5), **dense_tol)


@pytest.mark.parametrize("window,cap", [(5, None), (None, 2.0), (20, 4.0)])
@pytest.mark.parametrize("case", ["decode_only", "mixed", "prefix_hit"])
def test_sliding_window_and_soft_cap(case, window, cap):
    specs = CASES[case]
    query, cache, meta, dense = prepared(specs, (4, 2), torch.float32, seed=3)
    # Scores large enough that the soft cap bends them.
    query = query * 4
    out = run_kernel(query, cache, meta, 0.5, window, cap)
    torch.testing.assert_close(out, run_reference(query, cache, meta, 0.5, window, cap), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out.double(), dense_reference(query, dense, specs, 0.5, window, cap),
                               atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size,head_dim,heads", [(4, 24, (6, 2)), (5, 8, (3, 1)), (32, 40, (4, 4))])
def test_any_block_size_head_dim_and_group(block_size, head_dim, heads):
    # Tiles span several blocks (4, and 5 which is no power of two) or part of one (32);
    # head dims and GQA groups that are no powers of two are masked.
    specs = CASES["mixed"] + CASES["chunk_mid_block"]
    query, cache, meta, dense = prepared(specs, heads, torch.float32, block_size, head_dim, seed=4)
    out = run_kernel(query, cache, meta, head_dim**-0.5, window=9)
    torch.testing.assert_close(out, run_reference(query, cache, meta, head_dim**-0.5, 9), atol=2e-5, rtol=2e-5)
    decode_specs = CASES["decode_only"]
    query, cache, meta, dense = prepared(decode_specs, heads, torch.float32, block_size, head_dim, seed=5)
    out = run_kernel(query, cache, meta, head_dim**-0.5, window=9)
    torch.testing.assert_close(out, run_reference(query, cache, meta, head_dim**-0.5, 9), atol=2e-5, rtol=2e-5)


def test_prefill_tiles_of_several_query_tokens_per_program():
    # block_m 64 packs 32 tokens x 2 heads per program; the chunks start mid-block.
    specs = [(13, 40), (5, 11), (0, 33), (70, 1)]
    query, cache, meta, dense = prepared(specs, (4, 2), torch.float32, seed=6)
    out = paged_attention_prefill(query, cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                  meta.max_query_len, 0.3, block_m=64, block_n=32)
    torch.testing.assert_close(out.double(), dense_reference(query, dense, specs, 0.3), atol=1e-5, rtol=1e-5)


def test_decode_rows_with_no_context_return_zeros():
    # CUDA-graph replays pad the batch with rows of seq_len 0.
    query, cache, meta, dense = prepared(CASES["decode_only"], (4, 2), torch.float32)
    seq_lens = meta.seq_lens.clone()
    seq_lens[[1, 3]] = 0
    out = paged_attention_decode(query, cache, meta.block_tables, seq_lens, 0.3, **TILES)
    assert torch.all(out[[1, 3]] == 0)
    live = [0, 2, 4]
    ref = paged_attention_decode_ref(query[live], cache, meta.block_tables[live], meta.seq_lens[live], 0.3)
    torch.testing.assert_close(out[live], ref, atol=2e-5, rtol=2e-5)


def test_strided_query_from_a_fused_projection():
    query, cache, meta, dense = prepared(CASES["mixed"], (4, 2), torch.float32, seed=7)
    fused = torch.cat([query.flatten(1), torch.randn(query.shape[0], 32)], dim=1)
    strided = fused[:, :32].view(-1, 4, 8)
    assert not strided.is_contiguous()
    torch.testing.assert_close(run_kernel(strided, cache, meta, 0.3), run_kernel(query, cache, meta, 0.3))


def test_heads_not_a_multiple_of_kv_heads_is_an_error():
    query, cache, meta, _ = prepared(CASES["decode_only"], (4, 2), torch.float32)
    with pytest.raises(ValueError, match="num_heads"):
        paged_attention_decode(query[:, :3], cache, meta.block_tables, meta.seq_lens, 0.3)
