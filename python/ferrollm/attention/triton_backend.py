"""The GPU attention backend: the same two calls as :mod:`ferrollm.attention.cpu_backend`, done by
the Triton kernels in :mod:`ferrollm.kernels.triton`.

A decode-only step (every request has one query token) runs the decode kernel; any other step
runs the prefill kernel over all its requests, decode rows included, so a step is one launch and
nothing is read back to the host. The decode path reads only device tensors and fixed shapes,
which is what lets a CUDA graph replay it.
"""

from __future__ import annotations

import torch

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.kernels.triton import paged_attention_decode, paged_attention_prefill, reshape_and_cache

__all__ = ["NAME", "write_kv", "paged_attention"]

NAME = "TRITON"


def write_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes this step's keys and values into their cache slots; a negative slot is skipped.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]``.
        value: same shape as ``key``.
        kv_cache: one layer's cache, ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int64 ``[num_tokens]``, flat slot ``block_id * block_size + offset``.
    """
    reshape_and_cache(key, value, kv_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole context in the paged cache.

    Same contract as :func:`ferrollm.attention.cpu_backend.paged_attention`.

    Args:
        query: ``[num_tokens, num_heads, head_dim]``.
        kv_cache: one layer's cache, with this step's keys and values already written.
        meta: the step's metadata.
        scale: multiplier of ``q @ k``.
        sliding_window: a query at ``p`` sees keys ``> p - sliding_window`` only.
        logits_soft_cap: scores become ``cap * tanh(score / cap)`` before the softmax.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    """
    if meta.num_tokens == 0:
        return torch.empty_like(query)
    if meta.is_decode_only:
        return paged_attention_decode(query, kv_cache, meta.block_tables, meta.seq_lens, scale,
                                      sliding_window, logits_soft_cap)
    return paged_attention_prefill(query, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                                   meta.max_query_len, scale, sliding_window, logits_soft_cap)
