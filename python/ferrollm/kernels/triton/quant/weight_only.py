"""Weight-only int4 / int8 matmul: activations in float16, bfloat16 or float32, weights unpacked
in registers one [K, N] tile at a time, float32 accumulation.

The weight of output ``n`` and input ``k`` is ``q[n, k] * scales[n, g] + mins[n, g]`` with
``g = k // group_size``. Rather than dequantizing a tile, each K tile (which never straddles a
group) computes ``x . q`` with the integer codes as matmul operands, exact in every activation
dtype (|q| <= 128 has at most 8 significant bits), then scales it by the tile's group scale and
adds ``mins * sum(x)``: one multiply-add per output per tile instead of one per weight.

Layouts: ``bits=4``: uint8 ``[out, in / 2]``, input ``k`` in byte ``k // 2``, the low nibble for
even ``k``, codes 0..15; ``bits=8``: int8 ``[out, in]``, codes -128..127.

Costs: reads each weight byte once per ``BLOCK_M`` rows of ``x``; a decode batch (one tile of
rows) reads the packed weight once, split over K when its column tiles alone would leave SMs
idle (see :mod:`._split_k`; the splits hold whole tiles, so each still lies in one group).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrollm.kernels.triton.quant._common import (
    as_rows,
    block_k_within,
    check_bias,
    check_weight,
    dot_precision,
    launch_config,
    output_like,
)
from ferrollm.kernels.triton.quant._split_k import plan_split, split_k_range, store_tile

__all__ = ["wq_linear", "wq_linear_ref"]

@triton.jit
def _load_codes(qw_ptr, stride_qn, offs_n, mask_n, k0, K, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """The ``[BLOCK_K, BLOCK_N]`` tile of weight codes at ``k0`` (zero past ``K`` and ``N``)."""
    if BITS == 4:
        # Load the bytes as [N, K / 2] (contiguous, vectorised), split the nibbles and
        # interleave them back into K order: the low nibble is the even input.
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        mask = mask_n[:, None] & (j < K // 2)[None, :]
        packed = tl.load(qw_ptr + offs_n[:, None] * stride_qn + j[None, :], mask=mask, other=0)
        codes = tl.trans(tl.interleave(packed & 0xF, packed >> 4))
    else:
        k = k0 + tl.arange(0, BLOCK_K)
        mask = (k < K)[:, None] & mask_n[None, :]
        codes = tl.load(qw_ptr + offs_n[None, :] * stride_qn + k[:, None], mask=mask, other=0)
    return codes


@triton.jit
def _wq_linear_kernel(out_ptr, partials_ptr, x_ptr, qw_ptr, scales_ptr, mins_ptr, bias_ptr,
                      M, N, K, group_size, stride_xm, stride_qn, stride_sn, stride_om,
                      BITS: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr,
                      PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm
    scale_rows = offs_n.to(tl.int64) * stride_sn
    qw_ptr += (tl.program_id(1) * BLOCK_N).to(tl.int64) * stride_qn  # 64-bit row offset once
    local_n = tl.arange(0, BLOCK_N)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo, k_hi = split_k_range(K, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & (offs_k < K)[None, :], other=0.0)
        codes = _load_codes(qw_ptr, stride_qn, local_n, mask_n, k0, K, BITS, BLOCK_K)
        part = tl.dot(x, codes.to(x.dtype), input_precision=PRECISION)
        group = k0 // group_size  # the tile lies inside one group (checked by the caller)
        scale = tl.load(scales_ptr + scale_rows + group, mask=mask_n, other=0.0)
        acc += part * scale[None, :]
        if HAS_MINS:
            low = tl.load(mins_ptr + scale_rows + group, mask=mask_n, other=0.0)
            acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * low[None, :]
    store_tile(out_ptr, partials_ptr, bias_ptr, acc, offs_m, offs_n, M, N, stride_om, HAS_BIAS, SPLIT)


def _check_groups(in_features: int, group_size: int) -> None:
    if group_size != in_features and (group_size % 16 or group_size <= 0 or in_features % group_size):
        raise ValueError("`group_size` must be in_features or a multiple of 16 dividing in_features "
                         f"({in_features}). Given: {group_size}")


def _check_scales(scales: torch.Tensor, mins: torch.Tensor | None, shape: tuple[int, int]) -> None:
    for name, t in (("scales", scales), ("mins", mins)):
        # is_contiguous ignores the strides of size-1 dimensions: one group per row (a GPTQ
        # group_size of -1) may come as a transposed [1, out] view, which the kernel reads
        # through stride(0) alone.
        if t is not None and (t.dtype != torch.float32 or tuple(t.shape) != shape or not t.is_contiguous()):
            raise ValueError(f"`{name}` must be contiguous float32 of shape {shape}. "
                             f"Given: {t.dtype} {tuple(t.shape)}, strides {t.stride()}")
    if mins is not None and mins.stride(0) != scales.stride(0):
        raise ValueError(f"`mins` must have the row stride of `scales` ({scales.stride(0)}). Given: {mins.stride(0)}")


def wq_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
              bits: int, group_size: int, bias: torch.Tensor | None = None, *,
              split_k: int | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` for a weight stored as int4 or int8 codes with float32 group scales.

    Args:
        x: ``[..., in]`` float16, bfloat16 or float32.
        qweight: bits=4: uint8 ``[out, in // 2]`` (low nibble = even input, codes 0..15);
            bits=8: int8 ``[out, in]``.
        scales: float32 ``[out, in // group_size]``.
        mins: ``None`` or float32 like ``scales``, added after scaling:
            ``W[n, k] = q[n, k] * scales[n, k // group_size] + mins[n, k // group_size]``.
        bits: 4 or 8.
        group_size: inputs per scale: ``in``, or a multiple of 16 dividing ``in``.
        bias: ``None`` or ``[out]``.
        split_k: K ranges to split the product into (at most one per K tile); ``None`` splits
            decode batches that would leave SMs idle (see :mod:`._split_k`).

    Returns:
        ``[..., out]`` in ``x``'s dtype, accumulated in float32 and rounded once.
    """
    if bits not in (4, 8):
        raise ValueError(f"`bits` must be 4 or 8. Given: {bits}")
    out_features = qweight.shape[0]
    in_features = qweight.shape[1] * (2 if bits == 4 else 1)
    check_weight(qweight, "qweight", torch.uint8 if bits == 4 else torch.int8, tuple(qweight.shape))
    _check_groups(in_features, group_size)
    _check_scales(scales, mins, (out_features, in_features // group_size))
    check_bias(bias, out_features)
    rows = as_rows(x, in_features)
    out, out_rows = output_like(rows, x, out_features)
    if rows.shape[0] == 0 or out_features == 0:
        return out
    if group_size == in_features:  # one group: any tile width, the last tile masked
        block_k = min(128, max(16, triton.next_power_of_2(in_features)))
    else:
        block_k = block_k_within(group_size)
    config = launch_config(rows.shape[0], block_k)
    plan = plan_split(split_k, rows.shape[0], out_features, in_features, block_k, config, x.device)
    _wq_linear_kernel[plan.grid](
        out_rows, plan.target(out_rows), rows, qweight, scales,
        scales if mins is None else mins, scales if bias is None else bias,
        rows.shape[0], out_features, in_features, group_size, rows.stride(0), qweight.stride(0),
        scales.stride(0), out_rows.stride(0),
        BITS=bits, HAS_MINS=mins is not None, HAS_BIAS=bias is not None, PRECISION=dot_precision(x.dtype),
        SPLIT=plan.split, **config,
    )
    plan.finish(out_rows, bias)
    return out


def dequantize_weight_ref(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                          bits: int, group_size: int) -> torch.Tensor:
    """The float32 ``[out, in]`` weight that :func:`wq_linear` multiplies by."""
    if bits == 4:
        q = torch.stack([qweight & 0xF, qweight >> 4], dim=-1).reshape(qweight.shape[0], -1)
    else:
        q = qweight
    w = q.float() * scales.repeat_interleave(group_size, dim=1)
    if mins is not None:
        w = w + mins.repeat_interleave(group_size, dim=1)
    return w


def wq_linear_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                  bits: int, group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`wq_linear`: dequantize the whole weight to float32, then matmul."""
    w = dequantize_weight_ref(qweight, scales, mins, bits, group_size)
    y = x.float() @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
