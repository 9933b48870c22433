"""ferrollm's bf16-weight GEMM (``rust/kernels/src/gemm_bf16.rs``) on torch tensors.

The weight is bf16, packed once by :func:`pack` / :func:`pack_rows` into panels of column pairs;
``x``, ``bias`` and the output are fp32 or bf16, and every product is summed in fp32. The kernel is
the widest this CPU runs (:func:`kernel`: AMX tiles, AVX512-BF16 ``vdpbf16ps``, AVX-512F or AVX2
widening bf16 in registers, else a plain loop); ``FERROLLM_CPU_GEMM=portable`` forces the plain
loop, so tests cover it on any CPU, and ``FERROLLM_CPU_GEMM`` naming another kernel this CPU runs
picks that one (benchmarks compare them).
"""

from __future__ import annotations

import os

import torch

from ferrollm import _core
from ferrollm.kernels import cpu as _cpu

__all__ = ["KERNELS", "kernel", "linear", "pack", "pack_rows", "packed_len", "rows", "supported", "unpack"]

#: The loops, narrowest first; a CPU runs a prefix of them up to :func:`kernel`'s best.
KERNELS = ("portable", "avx2", "avx512", "avx512_bf16", "amx")


def kernel() -> str:
    """The loop :func:`linear` runs: ``amx``, ``avx512_bf16``, ``avx512``, ``avx2`` or ``portable``
    (``FERROLLM_CPU_GEMM`` when it names one of them; the Rust core refuses one this CPU lacks)."""
    asked = os.environ.get("FERROLLM_CPU_GEMM")
    if asked in KERNELS:
        return asked
    return _core.cpu_gemm_bf16_kernel()


def supported(weight: torch.Tensor) -> bool:
    """Whether :func:`pack` and :func:`linear` take this weight: bf16, 2-D, on the CPU, with
    torch's OpenMP team joined."""
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and _cpu.supports(weight)


def packed_len(out_features: int, in_features: int) -> int:
    """Elements (bf16) of the packed form of an ``[out_features, in_features]`` weight."""
    return _core.cpu_gemm_bf16_packed_len(out_features, in_features)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (``[out, in]``) in :func:`linear`'s layout: a flat bf16 tensor."""
    out_features, in_features = weight.shape
    packed = torch.zeros(packed_len(out_features, in_features), dtype=torch.bfloat16)
    pack_rows(weight, packed, out_features, 0)
    return packed


def pack_rows(rows: torch.Tensor, packed: torch.Tensor, out_features: int, first_row: int) -> None:
    """Packs ``rows`` (``[n, in]``, cast to bf16 if need be; unit stride along ``in``, any row
    stride: a rank's columns of a row-parallel weight qualify) as rows ``first_row .. first_row + n``
    of an ``[out_features, in]`` weight into ``packed`` (:func:`packed_len` elements, zeroed
    beforehand), leaving the rest of ``packed`` as it is."""
    rows = rows.detach()
    if rows.dtype != torch.bfloat16:
        rows = rows.to(torch.bfloat16)
    if rows.dim() != 2 or (rows.shape[0] > 1 and rows.stride(1) != 1):
        rows = rows.contiguous()
    n, in_features = rows.shape
    span = (rows.data_ptr(), 0 if n == 0 else (n - 1) * rows.stride(0) + in_features)
    _core.cpu_gemm_bf16_pack(span, _cpu._buf(packed), out_features, in_features, first_row, n,
                             rows.stride(0) if n > 1 else in_features, _cpu._threads())


def unpack(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The plain ``[out_features, in_features]`` bf16 weight that :func:`pack` packed."""
    return rows(packed, out_features, in_features, torch.arange(out_features))


def rows(packed: torch.Tensor, out_features: int, in_features: int, ids: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the weight :func:`pack` packed: ``[*ids.shape, in_features]``
    (a tied LM head's table serving its embedding's lookups)."""
    pairs = -(-in_features // 2)
    return _cpu.panel_rows(packed, out_features, pairs, 2, ids)[..., :in_features]


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
           loop: str | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` (``[rows, in]``, fp32 or bf16) and ``packed`` from
    :func:`pack` of ``weight``, summed in fp32 and rounded once to ``x``'s dtype, on torch's
    threads, by the loop ``loop`` names (one of :data:`KERNELS`; :func:`kernel`'s by default)."""
    x = x.contiguous()
    rows, in_features = x.shape
    out = x.new_empty((rows, out_features))
    bias = None if bias is None else bias.to(x.dtype).contiguous()
    _core.cpu_gemm_bf16(_cpu._NAMES[x.dtype], _cpu._buf(x), _cpu._buf(packed), None if bias is None else _cpu._buf(bias),
                        _cpu._buf(out), rows, out_features, in_features, loop or kernel(), _cpu._threads())
    return out
