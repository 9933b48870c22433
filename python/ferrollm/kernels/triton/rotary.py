"""Rotary position embedding applied in place to the query and key heads of each token.

``cos_sin_cache[p]`` holds ``rotary_dim / 2`` cosines then as many sines for position ``p``, the
table :class:`ferrollm.model_executor.layers.rotary.RotaryEmbedding` builds. Each head's first
``rotary_dim`` features are rotated in pairs: ``(i, i + rotary_dim / 2)`` in GPT-NeoX style,
``(2i, 2i + 1)`` in GPT-J style; the rest of the head is left alone. The rotation is computed in
float32 and rounded once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrollm.kernels.triton._utils import check_last_dim_contiguous

__all__ = ["rotary_embedding", "rotary_embedding_ref"]


@triton.jit
def _rotate_heads(x_ptr, stride_head, num_heads, cos, sin, offs_r, r_mask, half,
                  BLOCK_H: tl.constexpr, IS_NEOX: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < num_heads)[:, None] & r_mask[None, :]
    if IS_NEOX:
        first, second = offs_r, offs_r + half
    else:
        first, second = 2 * offs_r, 2 * offs_r + 1
    ptr1 = x_ptr + offs_h[:, None] * stride_head + first[None, :]
    ptr2 = x_ptr + offs_h[:, None] * stride_head + second[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptr1, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptr2, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, q_ptr, k_ptr, cache_ptr,
    num_heads, num_kv_heads, half, stride_cache,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_KH: tl.constexpr, IS_NEOX: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < half
    cos = tl.load(cache_ptr + pos * stride_cache + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(cache_ptr + pos * stride_cache + half + offs_r, mask=r_mask, other=0.0).to(tl.float32)[None, :]
    _rotate_heads(q_ptr + token * stride_q_tok, stride_q_head, num_heads, cos, sin, offs_r, r_mask, half,
                  BLOCK_H, IS_NEOX)
    _rotate_heads(k_ptr + token * stride_k_tok, stride_k_head, num_kv_heads, cos, sin, offs_r, r_mask, half,
                  BLOCK_KH, IS_NEOX)


def rotary_embedding(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool = True,
) -> None:
    """Rotates ``query`` and ``key`` in place by each token's position.

    Args:
        positions: int ``[num_tokens]``.
        query: ``[num_tokens, num_heads * head_size]`` or ``[num_tokens, num_heads, head_size]``.
        key: the same for ``num_kv_heads``.
        head_size: size of one head.
        cos_sin_cache: ``[max_position, rotary_dim]``, cosines then sines.
        is_neox_style: rotate halves (GPT-NeoX, HF Llama) rather than even/odd pairs (GPT-J).
    """
    num_tokens = positions.shape[0]
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim > head_size or rotary_dim % 2:
        raise ValueError(f"`cos_sin_cache` width (rotary_dim) must be even and <= head_size ({head_size}). "
                         f"Given: {rotary_dim}")
    q, k = _heads(query, "query", num_tokens, head_size), _heads(key, "key", num_tokens, head_size)
    check_last_dim_contiguous(query=q, key=k, cos_sin_cache=cos_sin_cache)
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        positions, q, k, cos_sin_cache,
        q.shape[1], k.shape[1], rotary_dim // 2, cos_sin_cache.stride(0),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        BLOCK_R=triton.next_power_of_2(rotary_dim // 2), BLOCK_H=triton.next_power_of_2(q.shape[1]),
        BLOCK_KH=triton.next_power_of_2(k.shape[1]), IS_NEOX=is_neox_style,
    )


def rotary_embedding_ref(
    positions: torch.Tensor,
    query: torch.Tensor,
    key: torch.Tensor,
    head_size: int,
    cos_sin_cache: torch.Tensor,
    is_neox_style: bool = True,
) -> None:
    """Torch reference of :func:`rotary_embedding`, in place like the kernel."""
    rotary_dim = cos_sin_cache.shape[1]
    cos, sin = cos_sin_cache[positions.long()].float().chunk(2, dim=-1)
    cos, sin = cos[:, None], sin[:, None]
    for x in (query, key):
        heads = x.view(x.shape[0], -1, head_size)
        rot = heads[..., :rotary_dim].float()
        if is_neox_style:
            x1, x2 = rot.chunk(2, dim=-1)
            rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        else:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            rotated = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        heads[..., :rotary_dim] = rotated.to(x.dtype)


def _heads(x: torch.Tensor, name: str, num_tokens: int, head_size: int) -> torch.Tensor:
    """``[num_tokens, heads, head_size]`` view of ``x``; kernels write through it, so no copy."""
    if x.shape[0] != num_tokens or x.shape[-1] % head_size or x.dim() not in (2, 3):
        raise ValueError(f"`{name}` must be [num_tokens={num_tokens}, heads * {head_size}] or "
                         f"[num_tokens, heads, {head_size}]. Given: {tuple(x.shape)}")
    return x.view(num_tokens, -1, head_size)
