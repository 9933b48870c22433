"""W8A8 int8 matmul: int8 activations times int8 weights, int32 accumulation on the tensor cores.

``y[m, n] = s_x[m] * s_w[n] * sum_k (qx[m, k] - zp) * qw[n, k] + bias[n]``. Activations are
quantized first by :func:`~ferrollm.kernels.triton.quant.activations.scaled_int8_quant` (dynamic
per token, or a static per-tensor scale with a zero point); the matmul subtracts
``zp * sum_k qw[n, k]``, summed from the same weight tiles, instead of widening the operands.

The int32 sum is exact while it fits: ``in_features <= 65536`` keeps ``255 * 128 * in`` below
``2**31``. It becomes float32 once, at the end, rounded to nearest like the reference's; split
over K at decode (see :mod:`._split_k`), each split's exact sum becomes float32 once and the
splits add in float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrollm.kernels.triton.quant._common import (
    as_rows,
    check_bias,
    check_weight,
    launch_config,
    output_like,
)
from ferrollm.kernels.triton.quant._split_k import plan_split, split_k_range, store_tile
from ferrollm.kernels.triton.quant.activations import scaled_int8_quant, scaled_int8_quant_ref

__all__ = ["w8a8_linear", "w8a8_linear_ref"]

MAX_IN_FEATURES = 65536
_BLOCK_K = 128  # bytes of K per tile; 128 won the H100 sweep at 2048 rows (see launch_config)


@triton.jit
def _w8a8_kernel(out_ptr, partials_ptr, qx_ptr, sx_ptr, qw_ptr, sw_ptr, bias_ptr, zero_point,
                 M, N, K, stride_xm, stride_sx, stride_qn, stride_om,
                 HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_rows = qx_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    w_cols = qw_ptr + offs_n.to(tl.int64)[None, :] * stride_qn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.int32)
    col_sums = tl.zeros([BLOCK_N], tl.int32)
    k_lo, k_hi = split_k_range(K, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0)
        b = tl.load(w_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
        if HAS_ZP:
            col_sums += tl.sum(b.to(tl.int32), axis=0)
    if HAS_ZP:
        # The column sums cover this split's K range only, so the splits' corrections add up
        # to the whole one, applied once.
        acc -= zero_point * col_sums[None, :]
    s_x = tl.load(sx_ptr + offs_m * stride_sx, mask=mask_m, other=0.0)
    s_w = tl.load(sw_ptr + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * s_x[:, None] * s_w[None, :]  # scales are linear: each split scales its own
    store_tile(out_ptr, partials_ptr, bias_ptr, y, offs_m, offs_n, M, N, stride_om, HAS_BIAS, SPLIT)


def _check(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor) -> None:
    out_features, in_features = qweight.shape
    check_weight(qweight, "qweight", torch.int8, (out_features, in_features))
    if in_features > MAX_IN_FEATURES:
        raise ValueError(f"in_features must be <= {MAX_IN_FEATURES} (int32 accumulation). Given: {in_features}")
    if weight_scale.dtype != torch.float32 or weight_scale.numel() != out_features or weight_scale.dim() > 2:
        raise ValueError(f"`weight_scale` must be float32 [{out_features}] (per channel). "
                         f"Given: {weight_scale.dtype} {tuple(weight_scale.shape)}")


def w8a8_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                input_zero_point: int = 0, *, split_k: int | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with int8 weights and int8-quantized activations.

    Args:
        x: ``[..., in]`` float16, bfloat16 or float32.
        qweight: int8 ``[out, in]``, ``W = qweight * weight_scale[:, None]``.
        weight_scale: float32 ``[out]`` (or ``[out, 1]``), one scale per output channel.
        bias: ``None`` or ``[out]``.
        input_scale: ``None`` quantizes ``x`` per token, symmetric, at run time; else the static
            per-tensor scale (one element).
        input_zero_point: the static scale's zero point in [-128, 127] (asymmetric activations).
        split_k: K ranges to split the product into (at most one per K tile); ``None`` splits
            decode batches that would leave SMs idle (see :mod:`._split_k`).

    Returns:
        ``[..., out]`` in ``x``'s dtype.
    """
    _check(x, qweight, weight_scale)
    out_features, in_features = qweight.shape
    check_bias(bias, out_features)
    rows = as_rows(x, in_features)
    out, out_rows = output_like(rows, x, out_features)
    if rows.shape[0] == 0 or out_features == 0:
        return out
    qx, s_x = scaled_int8_quant(rows, input_scale, input_zero_point)
    zero_point = input_zero_point if input_scale is not None else 0
    config = launch_config(rows.shape[0], _BLOCK_K)
    plan = plan_split(split_k, rows.shape[0], out_features, in_features, _BLOCK_K, config, x.device)
    _w8a8_kernel[plan.grid](
        out_rows, plan.target(out_rows), qx, s_x, qweight, weight_scale,
        weight_scale if bias is None else bias, zero_point,
        rows.shape[0], out_features, in_features, qx.stride(0), 1 if input_scale is None else 0,
        qweight.stride(0), out_rows.stride(0),
        HAS_ZP=zero_point != 0, HAS_BIAS=bias is not None, SPLIT=plan.split,
        **config,
    )
    plan.finish(out_rows, bias)
    return out


def w8a8_linear_ref(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None,
                    input_zero_point: int = 0) -> torch.Tensor:
    """Torch reference of :func:`w8a8_linear`: the integer sum in float64 (exact), then the
    kernel's float32 operations in its order."""
    qx, s_x = scaled_int8_quant_ref(x, input_scale, input_zero_point)
    zero_point = input_zero_point if input_scale is not None else 0
    acc = (qx.double() - zero_point) @ qweight.double().T
    y = acc.float() * s_x.reshape(-1, 1) * weight_scale.reshape(1, -1)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])
