"""The Rust CPU kernels behind the layers (RMSNorm, SiLU-and-mul, NeoX rotary, the KV write,
paged decode and prefill attention) against the torch path each replaces, which stays their
reference."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.attention import cpu_backend
from ferrollm.attention.backend import AttentionMetadata
from ferrollm.exceptions import KernelError
from ferrollm.model_executor.layers.activation import SiluAndMul
from ferrollm.model_executor.layers.norm import GemmaRMSNorm, RMSNorm
from ferrollm.model_executor.layers.rotary import RotaryEmbedding
from helpers.paged_cases import build_case

pytestmark = pytest.mark.skipif(not cpu_kernels.supports(torch.zeros(1)),
                                reason="torch runs on a thread pool other than OpenMP")
DTYPES = [torch.float32, torch.bfloat16]
# The two paths round in different places; in bf16 they agree to about one rounding step.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def _randn(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cls", [RMSNorm, GemmaRMSNorm])
@pytest.mark.parametrize("rows", [1, 3, 400])  # 400 x 96 splits over the team
def test_rms_norm_matches_the_torch_path(dtype, cls, rows):
    norm = cls(96, eps=1e-5, params_dtype=dtype)
    with torch.no_grad():
        norm.weight.copy_(_randn(96, dtype=dtype, seed=1))
    x, residual = _randn(rows, 96, dtype=dtype, seed=2), _randn(rows, 96, dtype=dtype, seed=3)
    torch.testing.assert_close(norm(x), norm._normalize(x), **TOL[dtype])
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)
    torch.testing.assert_close(out, norm._normalize(x + residual), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_and_mul_matches_torch(dtype, rows):
    x = _randn(rows, 2 * 600, dtype=dtype) * 4
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(SiluAndMul()(x), F.silu(gate) * up, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotary
@pytest.mark.parametrize("rows", [1, 40])  # 40 rows split over the team
def test_rotary_rotates_the_strided_qkv_views(dtype, rotary_dim, rows):
    rope = RotaryEmbedding(64, rotary_dim, 512, 10000.0, dtype=dtype)
    qkv = _randn(rows, (4 + 2 + 2) * 64, dtype=dtype)
    q, k, v = qkv.split([4 * 64, 2 * 64, 2 * 64], dim=-1)
    positions = torch.randint(0, 512, (rows,), generator=torch.Generator().manual_seed(5))
    cos, sin = rope.cos_sin_cache[positions].chunk(2, dim=-1)
    want_q, want_k, before = rope._rotate(q, cos, sin), rope._rotate(k, cos, sin), qkv.clone()
    assert cpu_kernels.rotary_supported(positions, rope.cos_sin_cache, q, k)
    got_q, got_k = rope(positions, q, k)
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])
    assert torch.equal(qkv, before)  # the inputs are left as they were


def _decode_case(dtype, rows, num_heads=6, num_kv_heads=2, head_dim=32, seed=7):
    rng = np.random.default_rng(seed)
    specs = [(int(n), 1) for n in rng.integers(0, 90, rows)]
    query, k, v, cache, step, _ = build_case(specs, 16, num_heads, num_kv_heads, head_dim, dtype, seed)
    meta = AttentionMetadata.from_step(step, block_size=16)
    cpu_backend.write_kv(k, v, cache, meta.slot_mapping)
    return query, cache, meta


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 9])
@pytest.mark.parametrize("window, cap", [(None, None), (24, None), (None, 5.0)])
def test_paged_decode_matches_the_torch_path(dtype, rows, window, cap):
    query, cache, meta = _decode_case(dtype, rows)
    opts = (0.3, window, cap)
    got = cpu_kernels.paged_decode(query, cache, meta.block_tables, meta.seq_lens, *opts)
    want = cpu_backend._decode_torch(query, cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, opts)
    torch.testing.assert_close(got, want, **TOL[dtype])


@pytest.mark.parametrize("heads", [(9, 3, 64), (14, 2, 64), (4, 1, 64)])
def test_a_lone_request_splits_its_context_over_the_team(heads):
    # Fewer requests than threads: the team takes pieces of the request's context, merged by
    # their softmax mass; the sums are grouped differently from one thread's, so the two agree
    # to float32 rounding rather than bit for bit.
    query, k, v, cache, step, _ = build_case([(150, 1)], 16, *heads, torch.float32, 11)
    meta = AttentionMetadata.from_step(step, block_size=16)
    cpu_backend.write_kv(k, v, cache, meta.slot_mapping)
    args = (query, cache, meta.block_tables, meta.seq_lens, heads[2] ** -0.5)
    team = max(2, torch.get_num_threads())
    try:
        torch.set_num_threads(1)
        one = cpu_kernels.paged_decode(*args)
        torch.set_num_threads(team)
        shared = cpu_kernels.paged_decode(*args)
    finally:
        torch.set_num_threads(team)
    torch.testing.assert_close(shared, one, rtol=1e-5, atol=1e-6)
    want = cpu_backend._decode_torch(query, cache, meta.block_tables, meta.seq_lens, meta.max_seq_len,
                                     (heads[2] ** -0.5, None, None))
    torch.testing.assert_close(shared, want, **TOL[torch.float32])


# (num_heads, num_kv_heads, head_dim): groups of 7 and 8 (one value pass of up to 7 heads, then
# the rest), one head per KV head, head sizes of 3 and 5 vectors, and one the intrinsics kernels
# leave to the portable one (not a multiple of 16). `rust/kernels` tests each kernel on its own.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(14, 2, 64), (16, 2, 128), (4, 4, 64), (9, 1, 48), (7, 1, 80), (8, 1, 40)])
def test_paged_decode_matches_the_torch_path_across_head_layouts(dtype, heads):
    query, cache, meta = _decode_case(dtype, 7, *heads)
    opts = (heads[2] ** -0.5, None, None)
    got = cpu_kernels.paged_decode(query, cache, meta.block_tables, meta.seq_lens, *opts)
    want = cpu_backend._decode_torch(query, cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, opts)
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_paged_decode_refuses_an_empty_sliding_window():
    query, cache, meta = _decode_case(torch.float32, 2)
    with pytest.raises(KernelError, match=r"`sliding_window` must be > 0\. Given: 0"):
        cpu_kernels.paged_decode(query, cache, meta.block_tables, meta.seq_lens, 0.3, 0)


def test_paged_decode_refuses_a_block_id_outside_the_cache():
    query, cache, meta = _decode_case(torch.float32, 2)
    tables = meta.block_tables.clone()
    tables[1, 0] = cache.shape[1] + 5
    with pytest.raises(KernelError, match=r"`block_tables` must be a block id in 0\.\.\d+\. Given: \d+"):
        cpu_kernels.paged_decode(query, cache, tables, meta.seq_lens, 0.3)


prefill_kernel = pytest.mark.skipif(not cpu_kernels.paged_prefill_supported(torch.zeros(1, 1, 64), torch.zeros(1)),
                                    reason="the prefill kernel needs AVX-512")


def _prefill_case(dtype, query_len, num_computed, heads=(14, 2, 64), seed=3):
    query, k, v, cache, step, _ = build_case([(num_computed, query_len)], 16, *heads, dtype, seed)
    meta = AttentionMetadata.from_step(step, block_size=16)
    cpu_backend.write_kv(k, v, cache, meta.slot_mapping)
    return query, cache, meta.block_tables[0]


# Fresh prompts shorter and longer than a key block, chunks after a cached prefix; windows that
# cut blocks; groups of 7 (tiles across tokens), 1 and 4; head sizes 64 and 128.
@prefill_kernel
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("query_len, num_computed", [(1, 0), (9, 0), (150, 0), (37, 90)])
@pytest.mark.parametrize("window", [None, 30])
@pytest.mark.parametrize("heads", [(14, 2, 64), (4, 4, 64), (8, 2, 128)])
def test_paged_prefill_matches_the_torch_path(dtype, query_len, num_computed, window, heads):
    query, cache, table = _prefill_case(dtype, query_len, num_computed, heads)
    opts = (heads[2] ** -0.5, window, None)
    got = cpu_backend._prefill(query, cache, table, num_computed + query_len, num_computed, opts)
    want = cpu_backend._prefill_torch(query, cache, table, num_computed + query_len, num_computed, opts)
    torch.testing.assert_close(got, want, **TOL[dtype])
    if dtype == torch.float32:  # `_prefill` went through the kernel
        torch.testing.assert_close(cpu_kernels.paged_prefill(query, cache, table, num_computed, opts[0], window), got,
                                   rtol=0, atol=0)


@prefill_kernel
def test_paged_prefill_refuses_a_table_too_short_for_the_context():
    query, cache, table = _prefill_case(torch.float32, 40, 0)
    with pytest.raises(KernelError, match=r"`block_table` must be >= 3 blocks for a context of 40 tokens\. Given: 2"):
        cpu_kernels.paged_prefill(query, cache, table[:2], 0, 0.125)


def test_prefill_the_kernel_cannot_do_takes_the_torch_path():
    query, cache, table = _prefill_case(torch.float32, 20, 5, heads=(4, 2, 48))
    assert not cpu_kernels.paged_prefill_supported(query, cache)  # 48 is not a multiple of 64
    got = cpu_backend._prefill(query, cache, table, 25, 5, (0.2, None, None))
    torch.testing.assert_close(got, cpu_backend._prefill_torch(query, cache, table, 25, 5, (0.2, None, None)))


def test_layouts_the_kernels_cannot_read_take_the_torch_path():
    positions, table = torch.zeros(2, dtype=torch.int64), torch.zeros(16, 64)
    assert not cpu_kernels.rotary_supported(positions, table, torch.zeros(1, 64).expand(2, 64))
    assert not cpu_kernels.rotary_supported(positions, table, torch.zeros(64, 2).T)
    assert not cpu_kernels.rotary_supported(positions.int(), table, torch.zeros(2, 64))
    query, cache, meta = _decode_case(torch.float32, 2)
    strided_cache = torch.stack([cache, cache], dim=2)[:, :, 0]  # same values, strided
    got = cpu_backend._decode(query, strided_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len,
                              (0.3, None, None))
    want = cpu_backend._decode_torch(query, cache, meta.block_tables, meta.seq_lens, meta.max_seq_len,
                                     (0.3, None, None))
    torch.testing.assert_close(got, want)


def test_rotary_refuses_a_position_past_the_table():
    rope = RotaryEmbedding(64, 64, 16, 10000.0, dtype=torch.float32)
    q, k = torch.zeros(1, 64), torch.zeros(1, 64)
    with pytest.raises(KernelError, match=r"`positions` must be in 0\.\.16\. Given: 16"):
        rope(torch.tensor([16]), q, k)


def _kv_write_case(dtype, tokens, kv_heads=2, head_dim=16, num_blocks=6, block_size=4):
    """A fused qkv output's key and value views and a slot per token, no two alike."""
    qkv = _randn(tokens, (4 + 2 * kv_heads) * head_dim, dtype=dtype, seed=11)
    _, key, value = qkv.split([4 * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    key = key.contiguous().view(tokens, kv_heads, head_dim)  # rotary's output: contiguous
    value = value.view(tokens, kv_heads, head_dim)  # still rows of qkv: strided
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(3))[:tokens]
    cache = _randn(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype, seed=12)
    return key, value, cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [0, 1, 17])
def test_write_kv_matches_the_torch_path(dtype, tokens):
    key, value, cache, slots = _kv_write_case(dtype, tokens)
    assert cpu_kernels.write_kv_supported(key, value, cache, slots)
    want = cache.clone()
    cpu_backend._write_kv_torch(key, value, want, slots)
    cpu_backend.write_kv(key, value, cache, slots)
    assert torch.equal(cache, want)


def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing():
    key, value, cache, slots = _kv_write_case(torch.float32, 3)
    slots[1] = cache[0].numel() // (2 * 16)  # one past the last slot
    before = cache.clone()
    with pytest.raises(KernelError, match=r"`slot_mapping` must be between 0 and 23\. Given: 24"):
        cpu_kernels.write_kv(key, value, cache, slots)
    assert torch.equal(cache, before)


def test_write_kv_leaves_other_layouts_to_torch():
    key, value, cache, slots = _kv_write_case(torch.float32, 5)
    assert not cpu_kernels.write_kv_supported(key, value, cache.half(), slots)  # other dtype
    assert not cpu_kernels.write_kv_supported(key, value, cache, slots.int())
    assert not cpu_kernels.write_kv_supported(key.transpose(1, 2), value, cache, slots)  # strided heads
    strided_cache = torch.stack([cache, cache], dim=2)[:, :, 0]
    assert not cpu_kernels.write_kv_supported(key, value, strided_cache, slots)
    want = cache.half().clone()
    cpu_backend._write_kv_torch(key, value, want, slots)
    got = cache.half().clone()
    cpu_backend.write_kv(key, value, got, slots)  # converts, as the torch path always did
    assert torch.equal(got, want)
