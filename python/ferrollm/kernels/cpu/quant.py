"""Quantized linear layers on the CPU: the Rust kernels of ``rust/kernels/src/quant/`` on torch
tensors. Weights stay quantized in memory and are unpacked in registers; one or two rows stream
each weight once, more rows decode a small tile at a time (never the whole weight).

- :func:`wq_linear`: weight-only int4 / int8 with group scales and optional mins, the form
  GPTQ, AWQ and compressed-tensors W4A16 / W8A16 (symmetric or not) all take once loaded:
  ``w[n, k] = q[n, k] * scales[n, k // group_size] + mins[n, k // group_size]``. int4 weights
  are packed once, at load, by :func:`pack_int4`.
- :func:`w8a8_linear`: int8 weights with a scale per output feature times int8 activations
  quantized inside the call (per token, dynamically, or per tensor with a given scale and zero
  point), integer products (AVX512-VNNI / AVX-VNNI where the CPU has them, else AVX2's exact
  16-bit products); the weight is laid out once, at load, by :func:`w8a8_pack`.
- :func:`fp8_linear`: float8_e4m3fn weights scaled per tensor, per output feature or per
  block (DeepSeek-style ``weight_scale_inv``), decoded in registers (no fp8 units needed), with
  activations kept in float32 or quantized to e4m3 and back (per tensor, dynamic or static, or
  per token per block of inputs) as vLLM's fp8 paths quantize them.

Activations are float32 ``[..., in_features]`` and so are the outputs; the kernels run on torch's
OpenMP team (as :mod:`ferrollm.kernels.cpu`'s do) with ``torch.get_num_threads()`` threads.
Arguments of the wrong dtype, device or layout raise :class:`~ferrollm.exceptions.KernelError`
naming the parameter; so do shapes the kernels do not take.
"""

from __future__ import annotations

import torch

from ferrollm import _core
from ferrollm.exceptions import KernelError
from ferrollm.kernels.cpu import _buf, _threads

__all__ = ["fp8_linear", "pack_int4", "w8a8_linear", "w8a8_pack", "wq_linear"]

_FP8_INPUTS = ("none", "tensor", "static", "group")


def _check(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...] | None = None) -> None:
    """Raises KernelError unless ``t`` is a contiguous CPU tensor of ``dtype`` (and ``shape``)."""
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous():
        raise KernelError(f"`{name}` must be a contiguous CPU {dtype} tensor. Given: {t.dtype} on {t.device}, "
                          f"contiguous={t.is_contiguous()}")
    if shape is not None and tuple(t.shape) != shape:
        raise KernelError(f"`{name}` must have shape {shape}. Given: {tuple(t.shape)}")


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a contiguous float32 ``[rows, in_features]`` tensor (leading dimensions flattened)."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() < 1:
        raise KernelError(f"`x` must be a float32 CPU tensor [..., in_features]. Given: {x.dtype} on {x.device}, "
                          f"{x.dim()} dimensions")
    return x.reshape(-1, x.shape[-1]).contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Packs int4 values for :func:`wq_linear` (once per layer, at load).

    Args:
        q: uint8 ``[out_features, in_features]``, one value 0..15 per element.

    Returns:
        uint8 ``[out_features, ceil(in_features / 32) * 16]``: each row's elements in blocks of
        32, byte ``i`` of a block holding element ``i`` in its low nibble and ``i + 16`` in its
        high one, the last block padded with zeros.

    Raises:
        KernelError: ``q`` is not a 2-D uint8 CPU tensor, or holds a value above 15.
    """
    if q.dim() != 2:
        raise KernelError(f"`q` must be 2-D [out_features, in_features]. Given: {tuple(q.shape)}")
    q = q.contiguous()
    _check("q", q, torch.uint8)
    out_features, in_features = q.shape
    packed = torch.empty(_core.cpu_wq_int4_packed_len(out_features, in_features), dtype=torch.uint8)
    _core.cpu_wq_pack_int4(_buf(q), _buf(packed), out_features, in_features, _threads())
    return packed.view(out_features, -1)


def wq_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None, bits: int,
              group_size: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ w.T + bias`` for a weight-only quantized ``w``.

    Args:
        x: float32 ``[..., in_features]``.
        qweight: ``bits=4``: :func:`pack_int4`'s uint8 output; ``bits=8``: int8
            ``[out_features, in_features]`` as stored (signed).
        scales: float32 ``[out_features, in_features // group_size]``, contiguous.
        mins: ``scales``' shape and dtype, added after scaling (``-zero_point * scale`` for
            asymmetric formats), or None.
        bits: 4 or 8.
        group_size: divides ``in_features``; 16, a multiple of 32, or ``in_features`` (per
            channel).
        bias: float32 ``[out_features]`` or None.

    Returns:
        float32 ``[..., out_features]``.

    Raises:
        KernelError: an argument of the wrong dtype, device, layout or shape, or a group size
            the kernel does not take.
    """
    x2 = _rows(x)
    rows, in_features = x2.shape
    if scales.dim() != 2:
        raise KernelError(f"`scales` must be 2-D [out_features, groups]. Given: {tuple(scales.shape)}")
    out_features = scales.shape[0]
    _check("scales", scales, torch.float32)
    if bits == 4:
        _check("qweight", qweight, torch.uint8, (out_features, -(-in_features // 32) * 16))
    elif bits == 8:
        _check("qweight", qweight, torch.int8, (out_features, in_features))
    else:
        raise KernelError(f"`bits` must be 4 or 8. Given: {bits}")
    if mins is not None:
        _check("mins", mins, torch.float32, tuple(scales.shape))
    if bias is not None:
        _check("bias", bias, torch.float32, (out_features,))
    out = torch.empty((rows, out_features), dtype=torch.float32)
    # Every tensor passed by address stays referenced here until the kernel returns.
    _core.cpu_wq_linear(_buf(x2), _buf(qweight), bits, _buf(scales), None if mins is None else _buf(mins),
                        None if bias is None else _buf(bias), _buf(out), rows, out_features, in_features,
                        group_size, _threads())
    return out.view(*x.shape[:-1], out_features)


def w8a8_pack(qweight: torch.Tensor) -> torch.Tensor:
    """Lays out an int8 weight for :func:`w8a8_linear` (once per layer, at load).

    Args:
        qweight: int8 ``[out_features, in_features]``.

    Returns:
        A flat uint8 tensor: tiles of 16 output features, each holding groups of 4 consecutive
        inputs of all 16 (the shape VNNI's ``vpdpbusd`` multiplies), then each feature's sum of
        weights as int32.
    """
    if qweight.dim() != 2:
        raise KernelError(f"`qweight` must be 2-D [out_features, in_features]. Given: {tuple(qweight.shape)}")
    qweight = qweight.contiguous()
    _check("qweight", qweight, torch.int8)
    out_features, in_features = qweight.shape
    packed = torch.empty(_core.cpu_w8a8_packed_len(out_features, in_features), dtype=torch.uint8)
    _core.cpu_w8a8_pack(_buf(qweight), _buf(packed), out_features, in_features, _threads())
    return packed


def w8a8_linear(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
                input_scale: float | torch.Tensor | None = None, input_zero_point: int | torch.Tensor = 0) -> torch.Tensor:
    """``s_x * s_w * ((q(x) - zp) @ qweight.T) + bias``: the W8A8 int8 product.

    Args:
        x: float32 ``[..., in_features]``.
        packed: :func:`w8a8_pack`'s output for an ``[out_features, in_features]`` weight.
        weight_scale: float32, one scale per output feature (``[out_features]`` or
            ``[out_features, 1]``).
        bias: float32 ``[out_features]`` or None.
        input_scale: None to quantize each row dynamically (``s = max|x_row| / 127``,
            symmetric, as vLLM's ``scaled_int8_quant``), else the static per-tensor scale.
        input_zero_point: the static zero point (asymmetric activations), -128..127:
            ``q = clamp(round(x / s) + zp, -128, 127)``; ignored when quantizing dynamically.

    Returns:
        float32 ``[..., out_features]``.

    Raises:
        KernelError: an argument of the wrong dtype, device or size, or a static scale that is
            not finite and positive, or a zero point out of range.
    """
    x2 = _rows(x)
    rows, in_features = x2.shape
    weight_scale = weight_scale.reshape(-1)
    out_features = weight_scale.shape[0]
    _check("weight_scale", weight_scale.contiguous(), torch.float32)
    weight_scale = weight_scale.contiguous()
    _check("packed", packed, torch.uint8, (_core.cpu_w8a8_packed_len(out_features, in_features),))
    if bias is not None:
        _check("bias", bias, torch.float32, (out_features,))
    scale = None if input_scale is None else float(input_scale)
    out = torch.empty((rows, out_features), dtype=torch.float32)
    _core.cpu_w8a8_linear(_buf(x2), _buf(packed), _buf(weight_scale), None if bias is None else _buf(bias), _buf(out),
                          rows, out_features, in_features, scale, int(input_zero_point), _threads())
    return out.view(*x.shape[:-1], out_features)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None,
               block_size: tuple[int, int] | list[int] | None = None, input_quant: str = "tensor",
               input_scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """``xq @ (e4m3(weight) * weight_scale).T + bias`` for an fp8 e4m3fn weight.

    Args:
        x: float32 ``[..., in_features]``.
        weight: ``[out_features, in_features]``, torch.float8_e4m3fn or its torch.uint8 view.
        weight_scale: float32: one scale (shape ``[]`` or ``[1]``), one per output feature
            (``[out_features]`` or ``[out_features, 1]``), or with ``block_size=(bo, bi)`` one
            per block, ``[ceil(out / bo), ceil(in / bi)]`` (``bi`` a multiple of 16).
        bias: float32 ``[out_features]`` or None.
        block_size: ``(bo, bi)`` for block scales, else None.
        input_quant: ``"none"``: float32 activations (weight-only); ``"tensor"``: quantized to
            e4m3 with ``s = max|x| / 448`` over the whole tensor (vLLM's dynamic fp8);
            ``"static"``: with ``input_scale``; ``"group"``: per token per ``bi`` inputs
            (block weights only). Quantized values saturate at ±448, ties to even.
        input_scale: the static activation scale.

    Returns:
        float32 ``[..., out_features]``.

    Raises:
        KernelError: an argument of the wrong dtype, device or shape, an unknown
            ``input_quant``, ``"group"`` without ``block_size``, a static scale missing or not
            finite and positive.
    """
    x2 = _rows(x)
    rows, in_features = x2.shape
    if weight.dtype == torch.float8_e4m3fn:
        weight = weight.view(torch.uint8)
    if weight.dim() != 2 or weight.shape[1] != in_features:
        raise KernelError(f"`weight` must be [out_features, {in_features}]. Given: {tuple(weight.shape)}")
    out_features = weight.shape[0]
    _check("weight", weight, torch.uint8)
    if input_quant not in _FP8_INPUTS:
        raise KernelError(f"`input_quant` must be one of {_FP8_INPUTS}. Given: {input_quant!r}")
    if input_quant == "static" and input_scale is None:
        raise KernelError("`input_scale` must be given with input_quant='static'. Given: None")
    _check("weight_scale", weight_scale, torch.float32)
    if block_size is not None:
        bo, bi = (int(v) for v in block_size)
        kind, block = "block", (bo, bi)
    else:
        kind, block = ("tensor" if weight_scale.numel() == 1 else "channel"), None
    if bias is not None:
        _check("bias", bias, torch.float32, (out_features,))
    scale = None if input_scale is None else float(input_scale)
    out = torch.empty((rows, out_features), dtype=torch.float32)
    _core.cpu_fp8_linear(_buf(x2), _buf(weight), _buf(weight_scale), kind, block, None if bias is None else _buf(bias),
                         _buf(out), rows, out_features, in_features, input_quant, scale, _threads())
    return out.view(*x.shape[:-1], out_features)
