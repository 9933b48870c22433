"""Activation quantization: rows of ``x`` to int8 or float8 (e4m3fn) with their scales, ahead of
the int8 and fp8 matmuls.

One program quantizes one (row, column group); a group is the whole row except in the fp8
``group_size`` mode. Dynamic scales take two passes over the group (absolute maximum, then
quantize), reading ``x`` twice and writing one byte per element. The formulas follow vLLM's, op
for op, so that each torch reference here gives the same bytes:

- int8, dynamic per token: ``s = amax / 127``, ``q = rne(x * (127 / amax))``;
- int8, static: ``q = rne(x / s) + zero_point``, both clamped to [-128, 127];
- fp8, static or per tensor (``s = amax / 448`` over the whole tensor): ``q = sat(x * (1 / s))``;
- fp8, per token and group: ``s = max(amax, 1e-10) / 448``, ``q = sat(x / s)``;

with ``rne`` rounding to nearest even and ``sat`` clamping to +-448 before rounding to e4m3. An
all-zero row gets scale 0 and zero codes. Divisions are IEEE (``tl.div_rn``) like torch's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrollm.kernels.triton.quant._common import FP8_MAX, INT8_MAX, as_rows, e4m3_encode, round_half_even

__all__ = ["scaled_fp8_quant", "scaled_fp8_quant_ref", "scaled_int8_quant", "scaled_int8_quant_ref"]

_FP8_GROUP_EPS = 1e-10  # floor of a group's absolute maximum, as vLLM's per-token-group quantizer
_MAX_BLOCK = 1024  # columns per pass


@triton.jit
def _group_absmax(x_row, start, end, BLOCK: tl.constexpr):
    amax = tl.zeros([BLOCK], tl.float32)
    for k0 in range(start, end, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < end, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return tl.max(amax, axis=0)


@triton.jit
def _quantize_rows_kernel(q_ptr, s_ptr, x_ptr, static_scale_ptr, zero_point, in_features, group_size,
                          num_groups, stride_x, stride_q,
                          FP8: tl.constexpr, DYNAMIC: tl.constexpr, AMAX_ONLY: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    start = group * group_size
    end = tl.minimum(start + group_size, in_features)
    x_row = x_ptr + row * stride_x
    if AMAX_ONLY:  # first half of the per-tensor fp8 scale; the caller takes the max over rows
        tl.store(s_ptr + row, _group_absmax(x_row, start, end, BLOCK))
    else:
        if DYNAMIC:
            amax = _group_absmax(x_row, start, end, BLOCK)
            if FP8:
                scale = tl.div_rn(tl.maximum(amax, 1e-10), 448.0)
                inv = 0.0  # unused: the group formula divides
            else:
                scale = tl.div_rn(amax, 127.0)
                inv = tl.where(amax > 0, tl.div_rn(127.0, tl.maximum(amax, 1e-30)), 0.0)
            tl.store(s_ptr + row * num_groups + group, scale)
        else:
            scale = tl.load(static_scale_ptr)
            inv = tl.where(scale > 0, tl.div_rn(1.0, tl.maximum(scale, 1e-30)), 0.0)
        for k0 in range(start, end, BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            mask = offs < end
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            q = _quantize(x, scale, inv, zero_point, FP8, DYNAMIC)
            tl.store(q_ptr + row * stride_q + offs, q, mask=mask)


@triton.jit
def _quantize(x, scale, inv, zero_point, FP8: tl.constexpr, DYNAMIC: tl.constexpr):
    if FP8:
        if DYNAMIC:
            y = tl.div_rn(x, scale)
        else:
            y = x * inv
        q = e4m3_encode(tl.clamp(y, -448.0, 448.0))
    elif DYNAMIC:
        q = round_half_even(tl.clamp(x * inv, -128.0, 127.0)).to(tl.int8)
    else:
        # rne(x / s) + zp, clamped, is rne(x / s clamped to [-128 - zp, 127 - zp]) + zp.
        y = tl.clamp(tl.div_rn(x, scale), -128.0 - zero_point, 127.0 - zero_point)
        q = (round_half_even(y) + zero_point).to(tl.int8)
    return q


def _launch(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, static_scale: torch.Tensor | None,
            zero_point: int, group_size: int, *, fp8: bool, amax_only: bool = False) -> None:
    rows, k = x.shape
    num_groups = triton.cdiv(k, group_size)
    if rows == 0 or k == 0:
        return
    dynamic = static_scale is None
    _quantize_rows_kernel[(rows, 1 if amax_only else num_groups)](
        q, scales, x, scales if dynamic else static_scale, zero_point, k, group_size, num_groups,
        x.stride(0), q.stride(0),
        FP8=fp8, DYNAMIC=dynamic, AMAX_ONLY=amax_only,
        BLOCK=min(_MAX_BLOCK, triton.next_power_of_2(group_size)),
    )


def _static_scale(scale: torch.Tensor, name: str) -> torch.Tensor:
    if scale.numel() != 1:
        raise ValueError(f"`{name}` must hold one (per-tensor) scale. Given shape: {tuple(scale.shape)}")
    return scale.reshape(1).to(torch.float32)


def scaled_int8_quant(x: torch.Tensor, scale: torch.Tensor | None = None,
                      zero_point: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` to int8, symmetric per token, or with a static per-tensor scale.

    Args:
        x: ``[..., k]`` float16, bfloat16 or float32.
        scale: ``None`` for dynamic per-token scales, else the one static scale (any 1-element tensor).
        zero_point: the static scale's integer zero point (ignored when dynamic), in [-128, 127].

    Returns:
        ``(q, s)``: int8 ``[rows, k]`` (leading dimensions of ``x`` flattened) and float32
        scales, ``[rows]`` when dynamic, ``[1]`` when static; ``x ~= s * (q - zero_point)``.
    """
    rows = as_rows(x, x.shape[-1])
    if not -128 <= zero_point <= 127:
        raise ValueError(f"`zero_point` must be in [-128, 127]. Given: {zero_point}")
    q = torch.empty(rows.shape, dtype=torch.int8, device=x.device)
    if scale is None:
        s = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        _launch(rows, q, s, None, 0, max(1, rows.shape[1]), fp8=False)
        return q, s
    s = _static_scale(scale, "scale").to(x.device)
    _launch(rows, q, s, s, zero_point, max(1, rows.shape[1]), fp8=False)
    return q, s


def scaled_fp8_quant(x: torch.Tensor, scale: torch.Tensor | None = None,
                     group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantizes ``x`` to float8 e4m3fn, per tensor (dynamic or static) or per token and group.

    Args:
        x: ``[..., k]`` float16, bfloat16 or float32.
        scale: the static per-tensor scale; ``None`` computes it (per tensor, or per group).
        group_size: columns per scale, each row's groups scaled separately (dynamic only);
            ``None`` scales the whole tensor by one.

    Returns:
        ``(q, s)``: float8_e4m3fn ``[rows, k]`` and float32 scales, ``[1]`` per tensor or
        ``[rows, ceil(k / group_size)]``; ``x ~= s * q``.
    """
    rows = as_rows(x, x.shape[-1])
    k = rows.shape[1]
    q = torch.empty(rows.shape, dtype=torch.uint8, device=x.device)
    if group_size is not None:
        if scale is not None:
            raise ValueError("`scale` must be None with `group_size` (group scales are dynamic)")
        if group_size < 1:
            raise ValueError(f"`group_size` must be >= 1. Given: {group_size}")
        s = torch.empty(rows.shape[0], triton.cdiv(k, group_size), dtype=torch.float32, device=x.device)
        _launch(rows, q, s, None, 0, group_size, fp8=True)
        return q.view(torch.float8_e4m3fn), s
    if scale is None:
        row_amax = torch.zeros(rows.shape[0], dtype=torch.float32, device=x.device)
        _launch(rows, q, row_amax, None, 0, max(1, k), fp8=True, amax_only=True)
        amax = row_amax.max() if rows.shape[0] else torch.zeros((), device=x.device)
        scale = _divide(amax, FP8_MAX).reshape(1)
    s = _static_scale(scale, "scale").to(x.device)
    _launch(rows, q, s, s, 0, max(1, k), fp8=True)
    return q.view(torch.float8_e4m3fn), s


def _divide(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """``a / b`` rounded once, as ``tl.div_rn``: torch computes ``number / tensor`` (and, on CUDA,
    ``tensor / number``) as a product with a reciprocal, rounded twice."""
    like = a if isinstance(a, torch.Tensor) else b
    a = a if isinstance(a, torch.Tensor) else torch.full_like(like, a)
    b = b if isinstance(b, torch.Tensor) else torch.full_like(like, b)
    return a / b


def scaled_int8_quant_ref(x: torch.Tensor, scale: torch.Tensor | None = None,
                          zero_point: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`scaled_int8_quant` (the same float32 operations)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if scale is None:
        amax = rows.abs().amax(dim=1) if rows.shape[1] else rows.new_zeros(rows.shape[0])
        inv = torch.where(amax > 0, _divide(INT8_MAX, amax.clamp_min(1e-30)), 0.0)
        q = torch.round((rows * inv[:, None]).clamp(-128, 127))  # torch.round ties to even
        return q.to(torch.int8), _divide(amax, INT8_MAX)
    s = scale.reshape(1).float()
    y = (rows / s).clamp(-128 - zero_point, 127 - zero_point)
    return (torch.round(y) + zero_point).to(torch.int8), s


def scaled_fp8_quant_ref(x: torch.Tensor, scale: torch.Tensor | None = None,
                         group_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of :func:`scaled_fp8_quant` (the same float32 operations)."""
    rows = x.reshape(-1, x.shape[-1]).float()
    if group_size is not None:
        groups = rows.split(group_size, dim=1)
        amax = torch.stack([g.abs().amax(dim=1) for g in groups], dim=1)
        s = _divide(amax.clamp_min(_FP8_GROUP_EPS), FP8_MAX)
        y = torch.cat([g / s[:, i:i + 1] for i, g in enumerate(groups)], dim=1)
        return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s
    if scale is None:
        amax = rows.abs().max() if rows.numel() else rows.new_zeros(())
        scale = _divide(amax, FP8_MAX)
    s = scale.reshape(1).float()
    inv = torch.where(s > 0, _divide(1.0, s.clamp_min(1e-30)), 0.0)
    return (rows * inv).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s
