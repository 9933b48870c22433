"""Bidirectional attention inside image spans (Gemma 3's ``token_type_ids`` mask), on top of the
causal paged attention every backend does.

A query token inside an image also sees the image's later tokens: for such a query at context
position ``q`` in an image ``[start, end)``, key ``k`` is allowed when ``k <= q`` or
``start <= k < end``, and, in a sliding-window layer, also ``k > q - window`` (transformers'
AND(window, OR(causal, image))). The backend first computes every row causally; this module then
recomputes the rows of the step's image tokens from the paged cache with that mask, so no kernel
changes.

Invariant the scheduler keeps for such models (``disable_chunked_mm_input``): a step that
schedules any token of an image also schedules (or finds cached) all the image's later tokens, so
their keys are in the cache when the rows are recomputed.

Costs: per image and layer, one gather of the request's ``end`` cached positions and a dense
``[image tokens, end]`` score matrix; nothing for steps without image tokens (decode steps).
"""

from __future__ import annotations

import torch

from ferrollm.attention.backend import AttentionMetadata

__all__ = ["attend_image_spans"]


def attend_image_spans(out: torch.Tensor, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                       scale: float, sliding_window: int | None, soft_cap: float | None,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Overwrites, in ``out`` ``[num_tokens, num_heads, head_dim]``, the rows of the image
    tokens in ``meta.image_spans`` (``(request row, start, end)`` context positions) with
    attention under the image-bidirectional mask. ``query`` is ``[num_tokens, num_heads,
    head_dim]``; ``kv_cache`` this layer's paged cache, already holding the step's keys."""
    qsl = meta.query_start_loc.tolist()
    computed = meta.num_computed_tokens.tolist()
    for row, start, end in meta.image_spans or ():
        first = max(start, computed[row])  # image tokens before it lie in a prefix-cache hit
        if first >= end:
            continue
        lo = qsl[row] + first - computed[row]
        rows = slice(lo, lo + end - first)
        keys, values = _gather(kv_cache, meta, row, end, k_scale, v_scale)
        q_pos = torch.arange(first, end, device=query.device)[:, None]
        k_pos = torch.arange(end, device=query.device)[None, :]
        allowed = (k_pos <= q_pos) | (k_pos >= start)
        if sliding_window is not None:
            allowed &= k_pos > q_pos - sliding_window
        out[rows] = _attend(query[rows], keys, values, allowed, scale, soft_cap).to(out.dtype)


def _gather(kv_cache: torch.Tensor, meta: AttentionMetadata, row: int, end: int, k_scale: float,
            v_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The request's keys and values at positions ``0..end``, float32 ``[end, kv_heads, dim]``."""
    bs = meta.block_size
    pos = torch.arange(end, device=kv_cache.device)
    slots = meta.block_tables[row].to(kv_cache.device).long()[pos // bs] * bs + pos % bs
    flat = kv_cache.flatten(1, 2)
    return flat[0, slots].float() * k_scale, flat[1, slots].float() * v_scale


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
            soft_cap: float | None) -> torch.Tensor:
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)
