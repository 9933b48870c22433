"""Paged attention in plain torch: the CPU backend and the reference the Triton kernels are tested
against.

Each request's keys and values are read through its block table, so requests never see each
other's context. Decode rows (one query token) of a step are done together. On the CPU, for fp32
and bf16, the Rust kernel (`ferrollm.kernels.cpu.paged_decode`) reads each row's blocks where
they lie; otherwise (and as that kernel's reference, `_decode_torch`) their blocks are gathered
into ``[num_decodes, max_seq_len, num_kv_heads, head_dim]``, padding is masked by ``seq_lens``,
and one batched call does the work. Prefill chunks, a few per step, run one
request at a time to avoid padding every query to the longest chunk; on CPUs with AVX-512 (fp32
and bf16, head sizes a multiple of 64, no soft-capping) the Rust kernel
(`ferrollm.kernels.cpu.paged_prefill`) does each in place, ~3x torch's fused attention on a
Qwen2-0.5B prompt, else (and as its reference, `_prefill_torch`) the blocks are gathered.

An fp8 cache (`kv_cache_dtype="fp8"`, `"fp8_e5m2"`) holds ``key / k_scale`` and
``value / v_scale`` (vLLM's per-tensor scales, 1.0 by default), rounded to nearest even and
saturated at the format's largest value. The Rust kernels write it and read it in place in decode
rows; the torch paths (prefill chunks, and the references) gather its blocks, widen them to
float32 and multiply the scales back.

The work goes to torch's fused CPU attention (`scaled_dot_product_attention`): on the
development machine it halves a 512-token prefill and a 32-row decode against the unfused
scores/mask/softmax/matmul chain, which remains (`_attend`) for logit soft-capping, which the
fused kernel cannot do. Scores and softmax are computed in float32 whatever the cache dtype:
bf16 operands on the CPU go to the fused kernel as they are, since it accumulates scores and
softmax in float32 itself (and rounds the probabilities to bf16 for the value product, as HF's
bf16 attention does); that halves a 32-row decode layer (1.17 -> 0.55 ms, 200 tokens). Other
dtypes, and every dtype on accelerators (where this module is the Triton kernels' reference),
are widened to float32 first.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.attention.backend import AttentionMetadata

__all__ = ["NAME", "write_kv", "paged_attention"]

NAME = "TORCH"


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Writes this step's keys and values into their cache slots.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]``.
        value: same shape as ``key``.
        kv_cache: one layer's cache, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 ``[num_tokens]``, flat slot ``block_id * block_size + offset``.
        k_scale, v_scale: an fp8 cache stores ``key / k_scale`` and ``value / v_scale``.
    """
    if cpu_kernels.write_kv_supported(key, value, kv_cache, slot_mapping):
        return cpu_kernels.write_kv(key, value, kv_cache, slot_mapping, k_scale, v_scale)
    _write_kv_torch(key, value, kv_cache, slot_mapping, k_scale, v_scale)


def _write_kv_torch(key, value, kv_cache, slot_mapping, k_scale=1.0, v_scale=1.0):
    """`write_kv` in torch ops: the reference the Rust kernel is tested against."""
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    key, value = _to_cache(key, kv_cache.dtype, k_scale), _to_cache(value, kv_cache.dtype, v_scale)
    if is_fp8(kv_cache.dtype):  # torch has no fp8 index_copy_ on the CPU: copy the bytes
        kv_cache, key, value = kv_cache.view(torch.uint8), key.view(torch.uint8), value.view(torch.uint8)
    # kv_cache[i] is a contiguous slab, so this view aliases the cache.
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _to_cache(x, dtype, scale):
    """``x`` as the cache stores it: an fp8 cache saturates ``x / scale`` at its largest value
    (torch's cast alone would give NaN or infinity past it), as vLLM's cache kernels do."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-limit, limit).to(dtype)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole context in the paged cache.

    The new tokens' keys and values must already be in ``kv_cache`` (see :func:`write_kv`).

    Args:
        query: ``[num_tokens, num_heads, head_dim]``; ``num_heads`` is a multiple of the cache's
            ``num_kv_heads`` (grouped-query attention).
        kv_cache: one layer's cache, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        meta: the step's metadata.
        scale: multiplier of ``q @ k``, usually ``head_dim ** -0.5``.
        sliding_window: if set, a query at position ``p`` sees keys at positions
            ``> p - sliding_window`` only.
        logits_soft_cap: if set, scores become ``cap * tanh(scores / cap)`` before the softmax.
        k_scale, v_scale: what an fp8 cache's keys and values are multiplied by when read.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    """
    opts = (scale, sliding_window, logits_soft_cap)
    if is_fp8(kv_cache.dtype):
        return _paged_attention(query, kv_cache, meta, opts, (k_scale, v_scale))
    return _paged_attention(query, kv_cache, meta, opts, None)


def _paged_attention(query, kv_cache, meta, opts, kv_scales):
    if meta.num_tokens == 0:
        return torch.empty_like(query)
    if meta.is_decode_only:
        return _decode(query, kv_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, opts, kv_scales)
    out = torch.empty_like(query)
    rows = meta.rows
    if rows.decode_max_seq_len:
        decoded = _decode(query[rows.decode_tokens], kv_cache, rows.decode_block_tables, rows.decode_seq_lens,
                          rows.decode_max_seq_len, opts, kv_scales)
        out.index_copy_(0, rows.decode_tokens, decoded)
    for chunk in rows.prefills:
        start, end = chunk.start, chunk.end
        _prefill(query[start:end], kv_cache, meta.block_tables[chunk.row], chunk.seq_len, chunk.num_computed,
                 opts, out[start:end], kv_scales)
    return out


def _decode(query, kv_cache, block_tables, seq_lens, max_seq_len, opts, kv_scales=None):
    """One query token per row; rows are batched. Returns ``[rows, num_heads, head_dim]``."""
    if cpu_kernels.paged_decode_supported(query, kv_cache):
        return cpu_kernels.paged_decode(query, kv_cache, block_tables, seq_lens, *opts, *(kv_scales or ()))
    return _decode_torch(query, kv_cache, block_tables, seq_lens, max_seq_len, opts, kv_scales)


def _decode_torch(query, kv_cache, block_tables, seq_lens, max_seq_len, opts, kv_scales=None):
    """`_decode` in torch ops: the reference the Rust kernel is tested against."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-max_seq_len // block_size)
    keys, values = _gather(kv_cache, block_tables[:, :num_blocks], kv_scales)
    query_pos = (seq_lens.long() - 1)[:, None]
    scale, sliding_window, soft_cap = opts
    if soft_cap is not None:
        return _attend(query[:, None], keys, values, query_pos, *opts)[:, 0]
    rows, num_heads, dim = query.shape
    kv_heads = keys.shape[2]
    # The query heads sharing a KV head become that head's query rows: one matmul per KV head.
    dtype = _sdpa_dtype(query)
    q = query.to(dtype).view(rows, kv_heads, num_heads // kv_heads, dim)
    visible = _visible(query_pos, keys.shape[1], sliding_window)[:, None]  # [rows, 1, 1, ctx]
    out = F.scaled_dot_product_attention(q, keys.to(dtype).transpose(1, 2), values.to(dtype).transpose(1, 2),
                                         attn_mask=visible, scale=scale)
    return out.reshape(rows, num_heads, dim).to(query.dtype)


def _prefill(query, kv_cache, block_table, seq_len, num_computed, opts, out=None, kv_scales=None):
    """One request's query chunk, positions ``num_computed ..``: ``[q_len, heads, dim]``, written
    into ``out`` if given (the kernel writes there directly, without a result of its own to copy)."""
    scale, sliding_window, soft_cap = opts
    if soft_cap is None and cpu_kernels.paged_prefill_supported(query, kv_cache):
        return cpu_kernels.paged_prefill(query, kv_cache, block_table, num_computed, scale, sliding_window, out)
    result = _prefill_torch(query, kv_cache, block_table, seq_len, num_computed, opts, kv_scales)
    return result if out is None else out.copy_(result)


def _prefill_torch(query, kv_cache, block_table, seq_len, num_computed, opts, kv_scales=None):
    """`_prefill` in torch ops: the reference the Rust kernel is tested against."""
    block_size = kv_cache.shape[2]
    num_blocks = -(-seq_len // block_size)
    keys, values = _gather(kv_cache, block_table[None, :num_blocks], kv_scales)
    query_pos = torch.arange(num_computed, num_computed + len(query), device=query.device)
    scale, sliding_window, soft_cap = opts
    if soft_cap is not None:
        return _attend(query[None], keys, values, query_pos[None], *opts)[0]
    dtype = _sdpa_dtype(query)
    keys, values = keys[0, :seq_len].to(dtype).transpose(0, 1), values[0, :seq_len].to(dtype).transpose(0, 1)
    # A fresh prompt with no window is plain causal attention, which needs no mask.
    plain = num_computed == 0 and (sliding_window is None or sliding_window >= seq_len)
    visible = None if plain else _visible(query_pos, seq_len, sliding_window)
    out = F.scaled_dot_product_attention(query.to(dtype).transpose(0, 1)[None], keys[None], values[None],
                                         attn_mask=visible, is_causal=plain, scale=scale,
                                         enable_gqa=keys.shape[0] != query.shape[1])
    return out[0].transpose(0, 1).to(query.dtype)


def _sdpa_dtype(query):
    """The dtype the fused kernel gets its operands in (see the module doc)."""
    native = query.device.type == "cpu" and query.dtype == torch.bfloat16
    return query.dtype if native else torch.float32


def _visible(query_pos, ctx_len, sliding_window):
    """Which context slots each query sees: ``[..., q_len, ctx_len]`` bool for ``query_pos`` of
    shape ``[..., q_len]``. The causal test also hides padding past a row's context."""
    key_pos = torch.arange(ctx_len, device=query_pos.device)
    visible = key_pos <= query_pos[..., None]
    if sliding_window is not None:
        visible &= key_pos > query_pos[..., None] - sliding_window
    return visible


def _gather(kv_cache, block_tables, kv_scales=None):
    """Reads blocks into ``keys, values``, each ``[rows, num_blocks * block_size, kv_heads, dim]``;
    an fp8 cache's (``kv_scales`` given) widened to float32 and multiplied by its scales.

    `index_select` along the blocks' own dimension copies each block whole; advanced indexing
    (`kv_cache[:, ids]`) copies element by element, which measured 3x slower for 32 fp32 rows and
    13x slower for bf16 (1.2 ms against 0.09 ms per layer at 32 rows x 200 tokens)."""
    rows, num_blocks = block_tables.shape
    ids = block_tables.reshape(-1).long()
    shape = (rows, num_blocks * kv_cache.shape[2], *kv_cache.shape[-2:])
    keys, values = kv_cache[0].index_select(0, ids).view(shape), kv_cache[1].index_select(0, ids).view(shape)
    if kv_scales is None:
        return keys, values
    return keys.float() * kv_scales[0], values.float() * kv_scales[1]


def _attend(query, keys, values, query_pos, scale, sliding_window, soft_cap):
    """Masked attention in float32.

    Args:
        query: ``[rows, q_len, num_heads, dim]``.
        keys, values: ``[rows, ctx_len, kv_heads, dim]``; slot ``j`` holds context position ``j``.
        query_pos: ``[rows, q_len]`` context position of each query token. The causal mask
            also hides the padding past each row's context, whose positions exceed every query's.

    Returns:
        ``[rows, q_len, num_heads, dim]`` in ``query``'s dtype.
    """
    rows, q_len, num_heads, dim = query.shape
    kv_heads = keys.shape[2]
    group = num_heads // kv_heads
    # [rows, kv_heads, group * q_len, dim]: the heads sharing one KV head form a single matmul.
    q = query.float().reshape(rows, q_len, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    q = q.reshape(rows, kv_heads, group * q_len, dim)
    k = keys.float().transpose(1, 2)  # [rows, kv_heads, ctx, dim]
    v = values.float().transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    visible = _visible(query_pos, k.shape[2], sliding_window)
    # [rows, q_len, ctx] -> broadcast over kv_heads and group, matching q's row order.
    visible = visible[:, None, None].expand(rows, 1, group, q_len, k.shape[2])
    scores = scores.masked_fill(~visible.reshape(rows, 1, group * q_len, -1), float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [rows, kv_heads, group * q_len, dim]
    out = out.reshape(rows, kv_heads, group, q_len, dim).permute(0, 3, 1, 2, 4)
    return out.reshape(rows, q_len, num_heads, dim).to(query.dtype)
