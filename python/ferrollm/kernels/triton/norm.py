"""RMSNorm, alone and with the residual add fused in, one program per row.

The arithmetic follows :class:`ferrollm.model_executor.layers.norm.RMSNorm` step by step: the mean
square in float32, the normalised row rounded to the input dtype, then multiplied by the weight,
so a bfloat16 model gets the same bits as the torch layer up to the order of the float32 sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrollm.kernels.triton._utils import check_last_dim_contiguous

__all__ = ["fused_add_rms_norm", "fused_add_rms_norm_ref", "rms_norm", "rms_norm_ref"]

# One program holds a whole row in registers; wider rows would need a two-pass kernel.
MAX_HIDDEN_SIZE = 65536


@triton.jit
def _normalize(x, w_ptr, offs, mask, hidden_size, eps, dtype: tl.constexpr):
    """``weight * (x / rms(x)).to(dtype)`` for one float32 row (masked lanes are 0)."""
    mean_sq = tl.sum(x * x, axis=0) / hidden_size
    normed = (x * tl.rsqrt(mean_sq + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return normed * w


@triton.jit
def _rms_norm_kernel(out_ptr, x_ptr, w_ptr, hidden_size, eps, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    y = _normalize(x, w_ptr, offs, mask, hidden_size, eps, x_ptr.dtype.element_ty)
    tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(x_ptr, residual_ptr, w_ptr, hidden_size, eps, stride_x, stride_r,
                               BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden_size
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the input dtype like torch's `x + residual`, then normalised from that value.
    total = (x + r).to(x_ptr.dtype.element_ty)
    tl.store(residual_ptr + row * stride_r + offs, total.to(residual_ptr.dtype.element_ty), mask=mask)
    y = _normalize(total.to(tl.float32), w_ptr, offs, mask, hidden_size, eps, x_ptr.dtype.element_ty)
    tl.store(x_ptr + row * stride_x + offs, y.to(x_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    Args:
        x: ``[..., hidden_size]``.
        weight: ``[hidden_size]``.
        eps: added to the mean square.

    Returns:
        A new tensor shaped like ``x``, in the dtype torch's ``weight * x`` promotes to.
    """
    rows = _rows(x, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if rows.shape[0]:
        _rms_norm_kernel[(rows.shape[0],)](
            out, rows, weight, rows.shape[1], eps, rows.stride(0), rows.shape[1],
            BLOCK=triton.next_power_of_2(rows.shape[1]),
        )
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``residual = x + residual``, then ``x = rms_norm(residual)``.

    Args:
        x: ``[..., hidden_size]``, overwritten with the normalised sum.
        residual: same shape and dtype, overwritten with the sum.
        weight: ``[hidden_size]``.
        eps: added to the mean square.

    Returns:
        ``(x, residual)``, the two updated tensors, as ``RMSNorm(x, residual)`` returns them.
    """
    if residual.shape != x.shape or residual.dtype != x.dtype:
        raise ValueError(f"`residual` must match `x` ({tuple(x.shape)}, {x.dtype}). "
                         f"Given: {tuple(residual.shape)}, {residual.dtype}")
    rows, res_rows = _rows(x, weight), _rows(residual, weight)
    if rows.data_ptr() != x.data_ptr() or res_rows.data_ptr() != residual.data_ptr():
        raise ValueError("`x` and `residual` must be viewable as rows without a copy")
    if rows.shape[0]:
        _fused_add_rms_norm_kernel[(rows.shape[0],)](
            rows, res_rows, weight, rows.shape[1], eps, rows.stride(0), res_rows.stride(0),
            BLOCK=triton.next_power_of_2(rows.shape[1]),
        )
    return x, residual


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Torch reference of :func:`rms_norm` (the RMSNorm layer's arithmetic)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`fused_add_rms_norm`, in place like the kernel."""
    residual.copy_(x + residual)
    x.copy_(rms_norm_ref(residual, weight, eps))
    return x, residual


def _rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"`weight` must have shape ({hidden_size},). Given: {tuple(weight.shape)}")
    if hidden_size > MAX_HIDDEN_SIZE:
        raise ValueError(f"`hidden_size` must be <= {MAX_HIDDEN_SIZE}. Given: {hidden_size}")
    check_last_dim_contiguous(x=x)
    return x.reshape(-1, hidden_size)
