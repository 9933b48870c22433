"""KV-cache writes: each new token's key and value go to the flat slot the core's ``slot_mapping``
gives, ``block_id * block_size + offset``, in the layer's ``[2, num_blocks, block_size,
num_kv_heads, head_dim]`` cache.

A negative slot means "do not write": CUDA-graph replays pad a batch with such tokens.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrollm.kernels.triton._utils import check_last_dim_contiguous

__all__ = ["reshape_and_cache", "reshape_and_cache_ref"]


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, cache_ptr, slot_mapping_ptr,
    block_size, head_dim,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_c_kv, stride_c_block, stride_c_tok, stride_c_head,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    dst = (slot // block_size) * stride_c_block + (slot % block_size) * stride_c_tok + head * stride_c_head + offs_d
    key = tl.load(key_ptr + token * stride_k_tok + head * stride_k_head + offs_d, mask=d_mask)
    value = tl.load(value_ptr + token * stride_v_tok + head * stride_v_head + offs_d, mask=d_mask)
    tl.store(cache_ptr + dst, key.to(cache_ptr.dtype.element_ty), mask=d_mask)
    tl.store(cache_ptr + stride_c_kv + dst, value.to(cache_ptr.dtype.element_ty), mask=d_mask)


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Writes this step's keys and values into their cache slots.

    Args:
        key: ``[num_tokens, num_kv_heads, head_dim]``; the last dimension contiguous.
        value: same shape as ``key``.
        kv_cache: one layer's ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.
        slot_mapping: int ``[num_tokens]``; tokens with a negative slot are skipped.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    check_last_dim_contiguous(key=key, value=value, kv_cache=kv_cache)
    _reshape_and_cache_kernel[(num_tokens, num_kv_heads)](
        key, value, kv_cache, slot_mapping,
        kv_cache.shape[2], head_dim,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def reshape_and_cache_ref(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Torch reference of :func:`reshape_and_cache`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    num_kv_heads, head_dim = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, head_dim)[slots] = key[keep].to(kv_cache.dtype)
    kv_cache[1].view(-1, num_kv_heads, head_dim)[slots] = value[keep].to(kv_cache.dtype)
