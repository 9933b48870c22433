"""``silu(gate) * up`` over a fused ``[..., 2 * d]`` gate/up projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ferrollm.kernels.triton._utils import check_last_dim_contiguous

__all__ = ["silu_and_mul", "silu_and_mul_ref"]


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, d, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0.0).to(tl.float32)
    # Rounded between the two ops as torch's F.silu(gate) * up is.
    act = (gate * tl.sigmoid(gate)).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor, *, block: int = 1024) -> torch.Tensor:
    """The gated-MLP activation.

    Args:
        x: ``[..., 2 * d]``, gate first.
        block: features per program (a power of two).

    Returns:
        ``[..., d]`` in ``x``'s dtype.
    """
    if x.shape[-1] % 2:
        raise ValueError(f"the last dimension of `x` must be even (gate and up). Given: {x.shape[-1]}")
    check_last_dim_contiguous(x=x)
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    block = min(block, triton.next_power_of_2(d))
    if rows.shape[0]:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
            out, rows, d, rows.stride(0), d, BLOCK=block,
        )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`silu_and_mul` (the SiluAndMul layer)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
