"""The fp8 KV cache on the CPU (`kv_cache_dtype="fp8"`, `"fp8_e5m2"`): the Rust write stores the
same bytes as torch's cast of ``x / scale`` saturated at the format's largest value, and the
attention over an fp8 cache (Rust decode rows, torch prefill chunks) equals the float64 attention
over the values the cache holds, times its scales."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.paged_cases import build_case, dense_reference

from ferrollm.attention import cpu_backend
from ferrollm.attention.backend import AttentionMetadata
from ferrollm.kernels import cpu as cpu_kernels

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
# Prefill chunks with and without cached context, and decode rows.
SPECS = [(0, 9), (21, 1), (40, 7), (3, 1), (64, 1)]


def roundtrip(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """What a reader of an fp8 cache gets back for ``x``."""
    return cpu_backend._to_cache(x, dtype, scale).float() * scale


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rust_write_stores_torchs_bytes_and_saturates(cache_dtype, dtype):
    g = torch.Generator().manual_seed(0)
    tokens, heads, dim, num_slots = 37, 2, 48, 64
    # Wide values: some past e4m3's 448 after the scale, some in its subnormals.
    key = (torch.randn(tokens, heads, dim, generator=g) * torch.logspace(-4, 3, dim)).to(dtype)
    value = (torch.randn(tokens, heads, dim, generator=g) * 50).to(dtype)
    slots = torch.randperm(num_slots, generator=g)[:tokens]
    rust = torch.zeros(2, num_slots // 16, 16, heads, dim, dtype=cache_dtype)
    ref = rust.clone()
    assert cpu_kernels.write_kv_supported(key, value, rust, slots)
    cpu_kernels.write_kv(key, value, rust, slots, 0.5, 0.25)
    cpu_backend._write_kv_torch(key, value, ref, slots, 0.5, 0.25)
    assert torch.equal(rust.view(torch.uint8), ref.view(torch.uint8))
    assert rust.float().isfinite().all()


def _fp8_case(cache_dtype, k_scale, v_scale, num_heads=4, num_kv_heads=2, head_dim=32):
    query, new_k, new_v, cache, step, dense = build_case(SPECS, 16, num_heads, num_kv_heads, head_dim,
                                                         torch.float32, seed=3)
    fp8 = torch.empty(cache.shape, dtype=cache_dtype)
    fp8[0], fp8[1] = cpu_backend._to_cache(cache[0], cache_dtype, k_scale), cpu_backend._to_cache(
        cache[1], cache_dtype, v_scale)
    held = [(roundtrip(k, cache_dtype, k_scale), roundtrip(v, cache_dtype, v_scale)) for k, v in dense]
    return query, new_k, new_v, fp8, step, held


@pytest.mark.parametrize("cache_dtype", FP8)
def test_attention_over_an_fp8_cache_is_attention_over_its_values(cache_dtype):
    k_scale, v_scale = 0.03, 0.02
    query, new_k, new_v, cache, step, held = _fp8_case(cache_dtype, k_scale, v_scale)
    meta = AttentionMetadata.from_step(step, 16)
    cpu_backend.write_kv(new_k, new_v, cache, meta.slot_mapping, k_scale, v_scale)
    out = cpu_backend.paged_attention(query, cache, meta, 32**-0.5, k_scale=k_scale, v_scale=v_scale)
    want = dense_reference(query, held, SPECS, 32**-0.5)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rust_decode_over_fp8_matches_the_torch_reference(cache_dtype, dtype):
    k_scale, v_scale = 0.05, 0.04
    query, new_k, new_v, cache, step, _ = _fp8_case(cache_dtype, k_scale, v_scale, 8, 2, 64)
    meta = AttentionMetadata.from_step(step, 16)
    cpu_backend.write_kv(new_k, new_v, cache, meta.slot_mapping, k_scale, v_scale)
    rows = torch.tensor([i for i, (_, ql) in enumerate(SPECS) if ql == 1])
    tokens = meta.query_start_loc[rows].long()
    q = query[tokens].to(dtype)
    assert cpu_kernels.paged_decode_supported(q, cache)
    args = (q, cache, meta.block_tables[rows], meta.seq_lens[rows])
    rust = cpu_kernels.paged_decode(*args, 64**-0.5, None, None, k_scale, v_scale)
    ref = cpu_backend._decode_torch(*args, int(meta.seq_lens[rows].max()), (64**-0.5, None, None), (k_scale, v_scale))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(rust.float(), ref.float(), atol=tol, rtol=tol)


def test_fp8_cache_is_never_handed_to_the_prefill_kernel():
    query = torch.zeros(4, 2, 64)
    cache = torch.zeros(2, 3, 16, 1, 64, dtype=torch.float8_e4m3fn)
    assert not cpu_kernels.paged_prefill_supported(query, cache)
    assert np.dtype(np.uint8).itemsize == cache.element_size()
