"""FP8 (e4m3fn) matmul: float8 weights with per-tensor, per-channel or block scales, times
activations left as they are or quantized to float8 (per tensor, static, or per token and group).

On GPUs with float8 tensor cores (sm_89 and later) the tiles go to ``tl.dot`` as float8;
elsewhere, and in the interpreter, each byte is decoded in registers to float16 (or the
activation dtype), which is exact, so both paths compute the same products and differ only in
how the hardware sums them. On sm_90 the float8 dot accumulates with reduced precision inside a
tile; each ``BLOCK_K`` tile is promoted to the float32 accumulator.

Scales are applied where they change: per-tile factors (block weight scales, activation group
scales) multiply each tile's float32 partial sum; per-tensor and per-channel ones multiply the
result once (per K split at decode, see :mod:`._split_k`; they are linear). A K tile never
straddles a scale block, nor does a split, which holds whole tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrollm.kernels.triton.quant._common import (
    as_rows,
    block_k_within,
    check_bias,
    dot_precision,
    e4m3_decode,
    launch_config,
    output_like,
)
from ferrollm.kernels.triton.quant._split_k import plan_split, split_k_range, store_tile
from ferrollm.kernels.triton.quant.activations import scaled_fp8_quant, scaled_fp8_quant_ref

__all__ = ["fp8_linear", "fp8_linear_ref", "has_fp8_dot"]

INPUT_QUANT_MODES = ("none", "tensor", "static", "group")


@triton.jit
def _dot_tile(a, w, acc, A_FP8: tl.constexpr, FP8_DOT: tl.constexpr, PRECISION: tl.constexpr,
              BLOCK_K: tl.constexpr):
    """``acc + a @ w`` for a ``[BLOCK_M, BLOCK_K]`` activation tile and a ``[BLOCK_K, BLOCK_N]``
    tile of e4m3 weight bytes; ``a`` holds e4m3 bytes too when ``A_FP8``."""
    if A_FP8:
        if FP8_DOT:
            return tl.dot(a.to(tl.float8e4nv, bitcast=True), w.to(tl.float8e4nv, bitcast=True), acc,
                          max_num_imprecise_acc=BLOCK_K)
        else:
            return tl.dot(e4m3_decode(a).to(tl.float16), e4m3_decode(w).to(tl.float16), acc)
    else:
        if FP8_DOT:
            w_values = w.to(tl.float8e4nv, bitcast=True).to(a.dtype)
        else:
            w_values = e4m3_decode(w).to(a.dtype)
        return tl.dot(a, w_values, acc, input_precision=PRECISION)


@triton.jit
def _fp8_linear_kernel(out_ptr, partials_ptr, a_ptr, sa_ptr, w_ptr, sw_ptr, bias_ptr,
                       M, N, K, scale_block_n, scale_block_k,
                       stride_am, stride_sam, stride_wn, stride_swn, stride_om,
                       A_FP8: tl.constexpr, A_GROUP: tl.constexpr, W_BLOCK: tl.constexpr,
                       HAS_BIAS: tl.constexpr, FP8_DOT: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    a_rows = a_ptr + offs_m.to(tl.int64)[:, None] * stride_am
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    k_lo, k_hi = split_k_range(K, BLOCK_K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0)
        w = tl.load(w_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
        if A_GROUP or W_BLOCK:
            part = _dot_tile(a, w, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), A_FP8, FP8_DOT, PRECISION, BLOCK_K)
            kb = k0 // scale_block_k
            if W_BLOCK:
                rows = (offs_n // scale_block_n).to(tl.int64) * stride_swn
                part *= tl.load(sw_ptr + rows + kb, mask=mask_n, other=0.0)[None, :]
            if A_GROUP:
                part *= tl.load(sa_ptr + offs_m.to(tl.int64) * stride_sam + kb, mask=mask_m, other=0.0)[:, None]
            acc += part
        else:
            acc = _dot_tile(a, w, acc, A_FP8, FP8_DOT, PRECISION, BLOCK_K)
    if A_FP8 and not A_GROUP:
        acc *= tl.load(sa_ptr)
    if not W_BLOCK:
        acc *= tl.load(sw_ptr + offs_n * stride_swn, mask=mask_n, other=0.0)[None, :]
    store_tile(out_ptr, partials_ptr, bias_ptr, acc, offs_m, offs_n, M, N, stride_om, HAS_BIAS, SPLIT)


def has_fp8_dot(device: torch.device) -> bool:
    """Whether ``device`` has float8 tensor cores (CUDA sm_89 and later) for Triton to use."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _weight_bytes(weight: torch.Tensor) -> torch.Tensor:
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8) or weight.dim() != 2:
        raise ValueError(f"`weight` must be float8_e4m3fn (or its uint8 view) [out, in]. "
                         f"Given: {weight.dtype} {tuple(weight.shape)}")
    if weight.stride(-1) != 1:
        raise ValueError(f"`weight` must be contiguous in its last dimension. Given strides: {weight.stride()}")
    return weight.view(torch.uint8)


def _scale_layout(weight_scale: torch.Tensor, shape: tuple[int, int],
                  block_size: tuple[int, int] | None) -> tuple[torch.Tensor, int]:
    """``weight_scale`` as float32 and the stride between output rows of scales (0: one scale)."""
    out_features, in_features = shape
    s = weight_scale.to(torch.float32)
    if block_size is not None:
        bo, bi = block_size
        if bo < 1 or bi < 16 or bi % 16:
            raise ValueError(f"`block_size` must be (>= 1, a multiple of 16). Given: {block_size}")
        want = (triton.cdiv(out_features, bo), triton.cdiv(in_features, bi))
        if tuple(s.shape) != want:
            raise ValueError(f"`weight_scale` must have shape {want} for block_size {tuple(block_size)}. "
                             f"Given: {tuple(s.shape)}")
        s = s.contiguous()
        return s, s.stride(0)
    if s.numel() == 1:
        return s.reshape(1), 0
    if s.numel() == out_features and s.dim() <= 2 and s.shape[0] == out_features:
        return s.reshape(out_features).contiguous(), 1
    raise ValueError(f"`weight_scale` must have shape [], [1] or [{out_features}] (or block scales "
                     f"with `block_size`). Given: {tuple(s.shape)}")


def _quantize_input(rows: torch.Tensor, input_quant: str, input_scale: torch.Tensor | None,
                    block_size: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    if input_quant not in INPUT_QUANT_MODES:
        raise ValueError(f"`input_quant` must be one of {INPUT_QUANT_MODES}. Given: {input_quant!r}")
    if (input_quant == "static") != (input_scale is not None):
        raise ValueError("`input_scale` must be given exactly when `input_quant` is 'static'")
    if input_quant == "none":
        return rows, None
    if input_quant == "group":
        if block_size is None:
            raise ValueError("`input_quant='group'` needs block weight scales (`block_size`)")
        q, s = scaled_fp8_quant(rows, group_size=block_size[1])
    else:
        q, s = scaled_fp8_quant(rows, input_scale)
    return q.view(torch.uint8), s


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
               input_quant: str = "tensor", input_scale: torch.Tensor | None = None, *,
               fp8_dot: bool | None = None, split_k: int | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with a float8 e4m3fn weight.

    Args:
        x: ``[..., in]`` float16, bfloat16 or float32.
        weight: float8_e4m3fn or its uint8 view, ``[out, in]``.
        weight_scale: ``W = weight * scale``; shape ``[]``/``[1]`` (per tensor), ``[out]`` (per
            channel) or ``[ceil(out / bo), ceil(in / bi)]`` with ``block_size=(bo, bi)``.
        bias: ``None`` or ``[out]``.
        block_size: ``(bo, bi)`` for block scales, ``bi`` a multiple of 16.
        input_quant: ``"none"`` (weight-only), ``"tensor"`` (dynamic per-tensor scale),
            ``"static"`` (``input_scale``), ``"group"`` (dynamic per token and ``bi`` columns).
        input_scale: the static per-tensor activation scale.
        fp8_dot: use float8 tensor cores; ``None`` decides from ``x``'s device.
        split_k: K ranges to split the product into (at most one per K tile); ``None`` splits
            decode batches that would leave SMs idle (see :mod:`._split_k`).

    Returns:
        ``[..., out]`` in ``x``'s dtype.
    """
    w = _weight_bytes(weight)
    out_features, in_features = w.shape
    check_bias(bias, out_features)
    rows = as_rows(x, in_features)
    scales, stride_swn = _scale_layout(weight_scale, (out_features, in_features), block_size)
    a, a_scale = _quantize_input(rows, input_quant, input_scale, block_size)
    out, out_rows = output_like(rows, x, out_features)
    if rows.shape[0] == 0 or out_features == 0:
        return out
    bo, bi = block_size or (1, in_features)
    block_k = min(block_k_within(bi) if block_size else 128, max(16, triton.next_power_of_2(in_features)))
    # The float8 MMA takes K in steps of 32; narrower tiles take the decoding path.
    fp8_dot = (has_fp8_dot(x.device) if fp8_dot is None else fp8_dot) and block_k >= 32
    config = launch_config(rows.shape[0], block_k)
    plan = plan_split(split_k, rows.shape[0], out_features, in_features, block_k, config, x.device)
    _fp8_linear_kernel[plan.grid](
        out_rows, plan.target(out_rows), a, scales if a_scale is None else a_scale, w, scales,
        scales if bias is None else bias,
        rows.shape[0], out_features, in_features, bo, bi,
        a.stride(0), a_scale.stride(0) if input_quant == "group" else 0, w.stride(0), stride_swn, out_rows.stride(0),
        A_FP8=a_scale is not None, A_GROUP=input_quant == "group", W_BLOCK=block_size is not None,
        HAS_BIAS=bias is not None, FP8_DOT=fp8_dot, PRECISION=dot_precision(x.dtype),
        SPLIT=plan.split, **config,
    )
    plan.finish(out_rows, bias)
    return out


def _expand_weight_scale(weight_scale: torch.Tensor, shape: tuple[int, int],
                         block_size: tuple[int, int] | None) -> torch.Tensor:
    s = weight_scale.float()
    if block_size is None:
        return s.reshape(-1, 1) if s.numel() > 1 else s.reshape(1, 1)
    bo, bi = block_size
    return s.repeat_interleave(bo, dim=0)[:shape[0]].repeat_interleave(bi, dim=1)[:, :shape[1]]


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, block_size: tuple[int, int] | None = None,
                   input_quant: str = "tensor", input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Torch reference of :func:`fp8_linear`: activations quantized (by the reference quantizer)
    and dequantized, the weight dequantized, both to float32, then one matmul."""
    w8 = weight.view(torch.float8_e4m3fn)
    w = w8.float() * _expand_weight_scale(weight_scale, tuple(w8.shape), block_size)
    rows = x.reshape(-1, x.shape[-1]).float()
    if input_quant == "group":
        q, s = scaled_fp8_quant_ref(rows, group_size=block_size[1])
        rows = q.float() * s.repeat_interleave(block_size[1], dim=1)[:, :rows.shape[1]]
    elif input_quant in ("tensor", "static"):
        q, s = scaled_fp8_quant_ref(rows, input_scale)
        rows = q.float() * s
    y = rows @ w.T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])
