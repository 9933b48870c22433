"""GGUF tensors with the Rust block kernels (``rust/kernels/src/quant.rs``): decoded to floats,
or multiplied in place.

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16 and BF16 decode on torch's OpenMP team, bit
for bit as gguf-py's numpy ``gguf.quants.dequantize`` does (which stays the reference the tests
compare against, and the path for the other GGML types). For the 135M-parameter Q4_1 SmolLM2
file that is ~0.3 s instead of ~2 s on the 2-core development machine.

:func:`gguf_linear` computes ``x @ W.T`` from the blocks themselves (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
Q4_K, Q5_K, Q6_K), so a weight stays as the file's bytes: ``x`` is rounded to 8 bits with one scale
per group of the weight's block length (32; 256 for the K-quants), ``|error| <= max|x_group| / 254``
per element, and met in integer dot products.

On CPUs with AVX512-VNNI, Q4_0, Q4_1 and Q8_0 weights are re-laid once at load (:func:`interleave`,
the same bytes in groups of 16 rows), where one vector instruction serves 16 rows: a Qwen2-0.5B
Q4_0 gate/up product at one row went from ~10 GB/s of weights to the memory's pace.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferrollm import _core
from ferrollm.kernels.cpu import _threads, as_contiguous
from ferrollm.exceptions import KernelError

__all__ = ["InterleavedBlocks", "deinterleave", "dequantize", "dequantize_supported", "embedding", "gguf_linear",
           "gguf_linear_stacked",
           "gguf_linear_supported", "interleave", "interleave_preferred"]

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
# (elements, bytes) of one block of each type gguf_linear takes: GGML's layouts (ggml-common.h).
_BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
           12: (256, 144), 13: (256, 176), 14: (256, 210)}


def dequantize_supported(ggml_type: int) -> bool:
    """Whether :func:`dequantize` decodes tensors of this GGML type id."""
    return _core.cpu_gguf_supported(int(ggml_type))


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decodes one GGUF tensor.

    Args:
        data: the tensor's stored bytes, a C-contiguous ``uint8`` array (a view of the file).
        ggml_type: its GGML type id; see :func:`dequantize_supported`.
        shape: its shape in torch order.
        dtype: ``torch.float32`` or ``torch.bfloat16``.

    Returns:
        A fresh tensor of ``shape`` and ``dtype``.

    Raises:
        KernelError: for another type or dtype, or bytes that are not whole blocks of ``shape``.
    """
    if dtype not in _DTYPES:
        raise KernelError(f"`dtype` must be torch.float32 or torch.bfloat16. Given: {dtype}")
    if data.dtype != np.uint8 or not data.flags.c_contiguous:
        raise KernelError(f"`data` must be a C-contiguous uint8 array. Given: {data.dtype}, "
                          f"contiguous={data.flags.c_contiguous}")
    out = torch.empty(shape, dtype=dtype)
    address = data.__array_interface__["data"][0]
    # `data` and `out` stay referenced here until the kernel returns.
    _core.cpu_gguf_dequantize(int(ggml_type), (address, data.nbytes), _DTYPES[dtype],
                              (out.data_ptr(), out.numel()), _threads())
    return out


def embedding(table: torch.Tensor, ggml_type: int, ids: torch.Tensor, dim: int,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Rows ``ids`` of an embedding table kept as GGUF blocks, decoded: ``[*ids.shape, dim]``.

    One kernel call reads just those rows' blocks (at decode, one row per step, where a gather
    of the blocks and :func:`dequantize` took a dozen small ops).

    Args:
        table: uint8 ``[rows, row_bytes]``, each row's blocks contiguous (``stride(1) == 1``),
            usually a view of the memory-mapped file.
        ggml_type: its GGML type id; see :func:`dequantize_supported`.
        ids: int64 row ids, any shape, each in ``0..rows``.
        dim: elements per row.
        dtype: of the result (decoded in float32 unless it is bfloat16, then converted).

    Raises:
        KernelError: an id outside the table, or a row that is not whole blocks of ``dim``.
    """
    if table.dtype != torch.uint8 or table.dim() != 2 or table.stride(1) != 1:
        raise KernelError(f"`table` must be uint8 [rows, row_bytes] with stride(1) == 1. Given: {table.dtype} "
                          f"{list(table.shape)} strides {list(table.stride())}")
    flat = as_contiguous(ids.reshape(-1), torch.int64)
    decoded = dtype if dtype in _DTYPES else torch.float32
    out = torch.empty(*ids.shape, dim, dtype=decoded)
    span = (table.shape[0] - 1) * table.stride(0) + table.shape[1] if table.shape[0] else 0
    # `table`, `flat` and `out` stay referenced here until the kernel returns.
    _core.cpu_gguf_embedding(int(ggml_type), (table.data_ptr(), span), table.stride(0),
                             (flat.data_ptr(), flat.numel()), _DTYPES[decoded], (out.data_ptr(), out.numel()),
                             _threads())
    return out if decoded == dtype else out.to(dtype)


def gguf_linear_supported(ggml_type: int) -> bool:
    """Whether :func:`gguf_linear` computes from weights of this GGML type id."""
    return _core.cpu_gguf_linear_supported(int(ggml_type))


def gguf_linear(x: torch.Tensor, weight: torch.Tensor, ggml_type: int, in_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` with ``W`` given by its GGUF blocks, read in place on torch's threads.

    Args:
        x: float32 ``[rows, in_features]``.
        weight: uint8 ``[out_features, row_bytes]``, each row ``in_features / block_len`` whole
            blocks; ``weight.stride(1) == 1``, any row stride (a view of the file, or a
            tensor-parallel shard of whole blocks).
        ggml_type: its GGML type id; see :func:`gguf_linear_supported`.
        in_features: elements per row of ``W``.
        bias: float32 ``[out_features]``, or None.

    Returns:
        A fresh float32 ``[rows, out_features]``. It differs from ``x @ dequantize(W).T`` by the
        rounding of ``x`` to 8 bits: at most ``Σ_groups max|x_group| / 254 · Σ_group |w|`` per
        element (groups of the block length), plus float32 rounding.

    Raises:
        KernelError: for another type, dtypes or shapes that do not fit.
    """
    return gguf_linear_stacked(x, [(weight, ggml_type)], in_features, bias)


@dataclass(frozen=True)
class InterleavedBlocks:
    """A Q4_0, Q4_1 or Q8_0 weight as :func:`interleave` re-laid it: ``data`` flat uint8."""

    data: torch.Tensor
    ggml_type: int
    out_features: int


Segment = tuple[torch.Tensor, int] | InterleavedBlocks


def interleave_preferred(ggml_type: int) -> bool:
    """Whether :func:`interleave` pays for this type on this CPU (Q4_0, Q4_1, Q8_0 with
    AVX512-VNNI)."""
    return _core.cpu_gguf_interleave_preferred(int(ggml_type))


def interleave(weight: torch.Tensor, ggml_type: int, in_features: int) -> InterleavedBlocks:
    """``weight`` (as :func:`gguf_linear` takes it) re-laid in groups of 16 rows: the same bytes
    (the last group padded with zero rows), in a fresh tensor."""
    ggml_type, rows, row_stride, out_features = _weight_buffer(weight, ggml_type, in_features)
    data = torch.empty(_core.cpu_gguf_interleaved_len(ggml_type, out_features, in_features), dtype=torch.uint8)
    _core.cpu_gguf_interleave(ggml_type, rows, row_stride, out_features, in_features, (data.data_ptr(), data.numel()))
    return InterleavedBlocks(data, ggml_type, out_features)


def deinterleave(blocks: InterleavedBlocks, in_features: int) -> torch.Tensor:
    """The rows of an :func:`interleave`'d weight back in the file's layout: uint8
    ``[out_features, row_bytes]``."""
    block_len, block_bytes = _BLOCKS[blocks.ggml_type]
    out = torch.empty((blocks.out_features, in_features // block_len * block_bytes), dtype=torch.uint8)
    _core.cpu_gguf_deinterleave(blocks.ggml_type, (blocks.data.data_ptr(), blocks.data.numel()), blocks.out_features,
                                in_features, (out.data_ptr(), out.numel()))
    return out


def gguf_linear_stacked(x: torch.Tensor, weights: list[Segment], in_features: int,
                        bias: torch.Tensor | None = None, residual: bool = False) -> torch.Tensor:
    """:func:`gguf_linear` for a weight the file holds as several tensors (q, k, v; gate, up):
    ``x @ cat(W₀, W₁, ...).T + bias`` in one call, with one quantization of ``x``, the weights'
    output features side by side in the result. ``weights`` are ``(blocks, ggml_type)`` pairs as
    :func:`gguf_linear` takes them, or :class:`InterleavedBlocks`, of any supported types; ``bias``
    covers all their features.

    ``residual``: ``x`` is quantized to 8 bits and what that leaves over to 8 bits again, the two
    products summed (twice the integer work, one read of the weight): each element within
    ``max|x| / 254**2`` of its 32-block instead of ``max|x| / 254``. The LM head takes it, where
    8-bit rounding of the last hidden state can flip a greedy token."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != in_features:
        raise KernelError(f"`x` must be float32 [rows, {in_features}]. Given: {x.dtype} {list(x.shape)}")
    stacked = [segment_buffer(w, in_features) for w in weights]
    out_features = sum(s[3] for s in stacked)
    if bias is not None and (bias.dtype != torch.float32 or tuple(bias.shape) != (out_features,)):
        raise KernelError(f"`bias` must be float32 [{out_features}]. Given: {bias.dtype} {list(bias.shape)}")
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32)
    # `x`, `weights`, `bias` and `out` stay referenced here until the kernel returns.
    _core.cpu_gguf_linear(stacked, in_features, (x.data_ptr(), x.numel()), x.shape[0],
                          None if bias is None else (bias.data_ptr(), bias.numel()),
                          (out.data_ptr(), out.numel()), _threads(), residual)
    return out


def segment_buffer(segment: Segment, in_features: int) -> tuple[int, tuple[int, int], int, int, bool]:
    """``(ggml_type, (address, bytes), row_stride, out_features, interleaved)`` of one stacked
    weight, as the Rust products take it, checked."""
    if isinstance(segment, InterleavedBlocks):
        data = segment.data
        return segment.ggml_type, (data.data_ptr(), data.numel()), 0, segment.out_features, True
    return (*_weight_buffer(*segment, in_features), False)


def _weight_buffer(weight: torch.Tensor, ggml_type: int, in_features: int) -> tuple[int, tuple[int, int], int, int]:
    """``(ggml_type, (address, bytes), row_stride, out_features)`` of one weight, checked."""
    if ggml_type not in _BLOCKS:
        raise KernelError(f"`ggml_type` must be one of {sorted(_BLOCKS)} (Q4_0 ... Q6_K). Given: {ggml_type}")
    block_len, block_bytes = _BLOCKS[ggml_type]
    if in_features % block_len:
        raise KernelError(f"`in_features` must be a multiple of {block_len}. Given: {in_features}")
    row_bytes = in_features // block_len * block_bytes
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != row_bytes or weight.stride(1) != 1:
        raise KernelError(f"`weight` must be uint8 [out_features, {row_bytes}] with stride(1) == 1. Given: "
                          f"{weight.dtype} {list(weight.shape)} strides {list(weight.stride())}")
    out_features, row_stride = weight.shape[0], weight.stride(0)
    span = (out_features - 1) * row_stride + row_bytes if out_features else 0
    return int(ggml_type), (weight.data_ptr(), span), row_stride, out_features
