"""Paged attention in Triton, over the ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache.

Two kernels share one inner loop (:func:`_attend_tiles`), a flash-attention style online softmax
over tiles of ``BLOCK_N`` context positions. A tile may span several cache blocks: each position
looks its block id up in the request's block table, so any ``block_size`` works.

- :func:`paged_attention_decode`: one query token per request. A program owns one request and one
  KV head, and the query heads sharing that KV head (the GQA group) are the rows of its tile, so
  each key and value is read once per group.
- :func:`paged_attention_prefill`: a chunk of query tokens per request, at context positions
  ``seq_len - query_len .. seq_len - 1``: causal within the chunk, full over the cached prefix.
  A program owns ``BLOCK_Q`` tokens of one request and one KV head; its ``BLOCK_Q * group`` rows
  are token-major, head-minor.

Scores, the softmax state and the accumulator are float32 whatever the cache dtype. A query at
position ``p`` sees keys at ``p - sliding_window < k <= p``; with ``logits_soft_cap`` the scaled
scores become ``cap * tanh(score / cap)`` before the softmax. The torch references are the CPU
backend (:mod:`ferrollm.attention.cpu_backend`), which is what these kernels must agree with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrollm.attention import cpu_backend
from ferrollm.attention.backend import AttentionMetadata
from ferrollm.kernels.triton._utils import check_last_dim_contiguous

__all__ = [
    "paged_attention_decode",
    "paged_attention_decode_ref",
    "paged_attention_prefill",
    "paged_attention_prefill_ref",
]

_LOG2E = tl.constexpr(1.4426950408889634)
# The running max starts finite so that a row whose keys are all masked so far gives
# exp2(-inf - m) = 0 rather than exp2(-inf + inf) = NaN.
_M_INIT = tl.constexpr(-1.0e30)


@triton.jit
def _tanh(x):
    # tl has no tanh. exp(-2|x|) is in (0, 1], so nothing overflows for large scores.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@triton.jit
def _attend_tiles(
    q, q_pos, acc, m_i, l_i,
    cache_ptr, block_table_ptr, seq_len, kv_head, k_lo, k_hi,
    block_size, stride_c_kv, stride_c_block, stride_c_tok, stride_c_head,
    offs_d, d_mask, scale, soft_cap, window,
    BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Folds context positions ``k_lo .. k_hi - 1`` into the online-softmax state of ``q``'s rows.

    ``q`` is ``[M, BLOCK_D]`` in the cache dtype, ``q_pos`` ``[M]`` the rows' context positions,
    ``acc`` ``[M, BLOCK_D]`` and ``m_i``/``l_i`` ``[M]`` float32 (max in log2 units, and sum).
    """
    for start in range(k_lo, k_hi, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)
        in_ctx = key_pos < seq_len
        block_id = tl.load(block_table_ptr + key_pos // block_size, mask=in_ctx, other=0).to(tl.int64)
        offs = (block_id[:, None] * stride_c_block + (key_pos % block_size)[:, None] * stride_c_tok
                + kv_head * stride_c_head + offs_d[None, :])
        kv_mask = in_ctx[:, None] & d_mask[None, :]
        k = tl.load(cache_ptr + offs, mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        if HAS_SOFT_CAP:
            s = soft_cap * _tanh(s / soft_cap)
        visible = in_ctx[None, :] & (key_pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            visible = visible & (key_pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s * _LOG2E, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(cache_ptr + stride_c_kv + offs, mask=kv_mask, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _decode_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale, soft_cap, window, block_size, num_queries_per_kv, head_dim,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt,
    stride_c_kv, stride_c_block, stride_c_tok, stride_c_head,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + row)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    heads = kv_head * num_queries_per_kv + offs_g
    q_mask = (offs_g < num_queries_per_kv)[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + row * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=q_mask, other=0.0).to(cache_ptr.dtype.element_ty)
    q_pos = tl.zeros([BLOCK_G], dtype=tl.int32) + seq_len - 1
    k_lo = 0
    if HAS_WINDOW:
        k_lo = tl.maximum(seq_len - window, 0) // BLOCK_N * BLOCK_N
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(
        q, q_pos, acc, m_i, l_i,
        cache_ptr, block_tables_ptr + row * stride_bt, seq_len, kv_head, k_lo, seq_len,
        block_size, stride_c_kv, stride_c_block, stride_c_tok, stride_c_head,
        offs_d, d_mask, scale, soft_cap, window,
        BLOCK_N, HAS_WINDOW, HAS_SOFT_CAP, DOT_PRECISION,
    )
    # A request with seq_len 0 (a CUDA-graph padding row) has l_i = 0 and writes zeros.
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + row * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _prefill_kernel(
    out_ptr, q_ptr, cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale, soft_cap, window, block_size, num_queries_per_kv, head_dim,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head, stride_bt,
    stride_c_kv, stride_c_block, stride_c_tok, stride_c_head,
    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0)
    tile_start = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + row)
    q_len = tl.load(query_start_loc_ptr + row + 1) - q_start
    if tile_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + row)
    num_cached = seq_len - q_len
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    tok = tile_start + offs_m // num_queries_per_kv
    heads = kv_head * num_queries_per_kv + offs_m % num_queries_per_kv
    m_valid = (offs_m < BLOCK_Q * num_queries_per_kv) & (tok < q_len)
    q_mask = m_valid[:, None] & d_mask[None, :]
    # int64: token index x row stride outgrows int32 on long batches of wide fused projections.
    tok_index = (q_start + tok).to(tl.int64)
    q_offs = tok_index[:, None] * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0).to(cache_ptr.dtype.element_ty)
    q_pos = num_cached + tok
    # Keys past the tile's last query are causally hidden from all its rows.
    k_hi = tl.minimum(seq_len, num_cached + tile_start + BLOCK_Q)
    k_lo = 0
    if HAS_WINDOW:
        k_lo = tl.maximum(num_cached + tile_start - window + 1, 0) // BLOCK_N * BLOCK_N
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], _M_INIT, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc, m_i, l_i = _attend_tiles(
        q, q_pos, acc, m_i, l_i,
        cache_ptr, block_tables_ptr + row * stride_bt, seq_len, kv_head, k_lo, k_hi,
        block_size, stride_c_kv, stride_c_block, stride_c_tok, stride_c_head,
        offs_d, d_mask, scale, soft_cap, window,
        BLOCK_N, HAS_WINDOW, HAS_SOFT_CAP, DOT_PRECISION,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_offs = tok_index[:, None] * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :]
    tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention_decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    *,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of one new token per request over its context, the token's own K/V included.

    Args:
        query: ``[num_seqs, num_heads, head_dim]``, row ``i`` the last token of request ``i``.
        kv_cache: one layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: int32 ``[num_seqs, max_blocks]``.
        seq_lens: int32 ``[num_seqs]``, context length including the new token; a row with 0
            reads nothing and returns zeros.
        scale: multiplier of ``q @ k``.
        sliding_window: a query at ``p`` sees keys ``> p - sliding_window`` only.
        logits_soft_cap: scores become ``cap * tanh(score / cap)``.
        block_n: context positions per tile (a power of two, >= 16).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in ``query``'s dtype.
    """
    num_seqs, num_heads, head_dim = query.shape
    group = _group_size(num_heads, kv_cache)
    check_last_dim_contiguous(query=query, kv_cache=kv_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return out
    _decode_kernel[(num_seqs, kv_cache.shape[3])](
        out, query, kv_cache, block_tables, seq_lens,
        *_scalars(scale, sliding_window, logits_soft_cap), kv_cache.shape[2], group, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *kv_cache.stride()[:4],
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_D=_block_d(head_dim), BLOCK_N=block_n,
        **_flags(kv_cache, sliding_window, logits_soft_cap),
    )
    return out


def paged_attention_prefill(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    *,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:
    """Attention of each request's query chunk over its cached prefix and, causally, itself.

    Decode rows (chunks of one token) are handled too, so a mixed step is one launch.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``, request ``i``'s chunk at
            ``query_start_loc[i]:query_start_loc[i + 1]``.
        kv_cache: one layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]``, with the
            chunk's own keys and values already written.
        block_tables: int32 ``[num_reqs, max_blocks]``.
        seq_lens: int32 ``[num_reqs]``, context length after the chunk.
        query_start_loc: int32 ``[num_reqs + 1]``.
        max_query_len: the longest chunk; sizes the launch grid.
        scale, sliding_window, logits_soft_cap: as in :func:`paged_attention_decode`.
        block_m: query rows (tokens x heads of a GQA group) per program, a power of two >= 16.
        block_n: context positions per tile, a power of two >= 16.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    group = _group_size(num_heads, kv_cache)
    check_last_dim_contiguous(query=query, kv_cache=kv_cache)
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), kv_cache.shape[3])
    _prefill_kernel[grid](
        out, query, kv_cache, block_tables, seq_lens, query_start_loc,
        *_scalars(scale, sliding_window, logits_soft_cap), kv_cache.shape[2], group, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        *kv_cache.stride()[:4],
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_D=_block_d(head_dim), BLOCK_N=block_n,
        **_flags(kv_cache, sliding_window, logits_soft_cap),
    )
    return out


def paged_attention_decode_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`paged_attention_decode` (the CPU backend's decode path)."""
    num_seqs = query.shape[0]
    arange = torch.arange(num_seqs + 1, dtype=torch.int32, device=query.device)
    meta = _metadata(kv_cache, block_tables, seq_lens, arange, max_query_len=1)
    return cpu_backend.paged_attention(query, kv_cache, meta, scale, sliding_window, logits_soft_cap)


def paged_attention_prefill_ref(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Torch reference of :func:`paged_attention_prefill` (the CPU backend)."""
    meta = _metadata(kv_cache, block_tables, seq_lens, query_start_loc, max_query_len)
    return cpu_backend.paged_attention(query, kv_cache, meta, scale, sliding_window, logits_soft_cap)


def _metadata(kv_cache, block_tables, seq_lens, query_start_loc, max_query_len) -> AttentionMetadata:
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    num_reqs = seq_lens.shape[0]
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=seq_lens.device),
        block_tables=block_tables,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        num_computed_tokens=seq_lens - query_lens,
        num_reqs=num_reqs,
        num_tokens=int(query_start_loc[-1]) if num_reqs else 0,
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        block_size=kv_cache.shape[2],
    )


def _group_size(num_heads: int, kv_cache: torch.Tensor) -> int:
    num_kv_heads = kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"`num_heads` must be a multiple of the cache's num_kv_heads ({num_kv_heads}). "
                         f"Given: {num_heads}")
    return num_heads // num_kv_heads


def _block_d(head_dim: int) -> int:
    # tl.dot needs every dimension >= 16; head dims that are not powers of two are masked.
    return max(16, triton.next_power_of_2(head_dim))


def _scalars(scale, sliding_window, logits_soft_cap) -> tuple[float, float, int]:
    return float(scale), float(logits_soft_cap or 0.0), int(sliding_window or 0)


def _flags(kv_cache: torch.Tensor, sliding_window, logits_soft_cap) -> dict:
    return dict(
        HAS_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=logits_soft_cap is not None,
        # fp32 caches keep full precision; tf32 would cost ~3 decimal digits against the reference.
        DOT_PRECISION="ieee" if kv_cache.dtype == torch.float32 else "tf32",
    )
