"""The one form a CPU linear layer keeps its weight in, built as the checkpoint loads.

A layer holds a single copy of its weight, in the layout its products read (`cpu_weight_form`
picks it once per model, before loading):

- ``"packed"``, fp32 where ferrollm's GEMM runs (AVX-512): `PackedWeight`, the GEMM's panels,
  packed straight from each checkpoint tensor (q, k, v; gate, up; a rank's slice) as it arrives.
  No merged or dense copy is made, and the file pages the packing read are handed back.
- ``"rows"``, elsewhere in fp32 and bf16: `DenseRows`, the plain ``[out, in]`` weight. Where the
  dtype matches and the file holds the rows back to back (a whole tensor, gate/up) it is a view of
  the file's mapping, so loading copies nothing, the pages come from the page cache (shared with
  other processes and the other TP ranks) and only the rows an embedding looks up are ever read;
  q/k/v are merged into one copy. Products take the streaming GEMV for one or two rows, else
  oneDNN's `_linear_pointwise` on the plain weight. On the 2-core AVX2 development machine (fp32,
  2 threads, 24 cold weights cycled) the plain weight was as fast as oneDNN's blocked copy of it
  from 1 to 128 rows (a [9728, 896] gate/up: 2.2 against 2.3 ms at 4 rows, 5.2 against 5.2 at 32,
  16.5 against 16.1 at 128), so the blocked copy, which doubled the weights, is gone. Copying the
  0.94 GB of merged q/k/v and gate/up weights into fresh memory took 2.2 s of start-up on that VM.
- ``"packed_bf16"``, bf16 where ferrollm's kernels run: `PackedBf16Weight`, the bf16 GEMM's
  panels of column pairs (`kernels.cpu.gemm_bf16`), packed straight from each checkpoint tensor as
  ``"packed"`` is; every product, one row to a prefill, runs on it, summed in fp32. On the 2-core
  AVX2 development machine torch's own bf16 matmul (oneDNN has no bf16 there) was 4-9x slower
  from 8 rows on, and the kernel streams one or two rows as fast as the GEMV on the plain weight.
- ``"onednn"``, bf16 with ``FERROLLM_CPU_GEMM=onednn`` where oneDNN runs it natively
  (AVX512-BF16, AMX): `OneDnnWeight`, the dense weight and oneDNN's blocked copy, the form bf16
  took before ``"packed_bf16"``, kept to compare the two.

A layer's own ``weight`` parameter then stays on the meta device (shape and dtype, no memory);
`dense()` rebuilds the plain weight where one is needed (saving sharded state).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch
import torch.nn.functional as F

from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.kernels.cpu import gemm_bf16
from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.weight_utils import is_shareable, materialize

__all__ = ["CpuWeight", "DenseRows", "OneDnnWeight", "PackedBf16Weight", "PackedWeight", "RowBlocks", "build_cpu_weight",
           "checkpoint_mappings", "cpu_weight_form", "dense_linear", "release_pages"]


def cpu_weight_form(device: torch.device, dtype: torch.dtype) -> str | None:
    """The form CPU linear layers of ``dtype`` keep their weights in: ``"packed"``, ``"packed_bf16"``,
    ``"onednn"``, ``"rows"``, or None (not the CPU, or a dtype the kernels do not take: plain `F.linear`)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return None
    if cpu_kernels.gemm_supported(torch.empty(0, 0, dtype=dtype)):
        return "packed"
    if dtype == torch.bfloat16 and os.environ.get("FERROLLM_CPU_GEMM") == "onednn" and _onednn_runs(dtype):
        return "onednn"
    if gemm_bf16.supported(torch.empty(0, 0, dtype=dtype)):
        return "packed_bf16"
    return "rows"


def _onednn_runs(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available() or os.environ.get("FERROLLM_CPU_ONEDNN", "1") == "0":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` from a plain ``[out, in]`` weight: the streaming GEMV for one or two
    rows, oneDNN from three, `F.linear` where neither takes the operands."""
    if cpu_kernels.gemv_supported(x, weight):
        return cpu_kernels.gemv(x, weight, bias)
    # `is_cpu` first: on a GPU this is plain F.linear, with no Python call torch.compile breaks on.
    if (x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 2 and x.shape[0] > 0
            and x.dtype == weight.dtype and weight.is_contiguous() and _onednn_runs(x.dtype)):
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class RowBlocks:
    """A weight's rows as the loaders hand them over, until all ``out_features`` have come.

    A block that is a view of the checkpoint's mapping in the right dtype is kept as it is (no
    copy); any other is copied once (cast, made contiguous, a lazily read window materialized).
    """

    def __init__(self, out_features: int, in_features: int, dtype: torch.dtype):
        self.out_features, self.in_features, self.dtype = out_features, in_features, dtype
        self.blocks: list[tuple[int, torch.Tensor]] = []
        self.num_rows = 0

    def add(self, first_row: int, src: torch.Tensor, what: str) -> None:
        """Takes rows ``first_row ..`` of the weight.

        Raises:
            CheckpointError: the rows do not fit the weight (naming ``what`` and the shapes).
        """
        rows = src.shape[0]
        if not isinstance(src, torch.Tensor):  # a quantized weight (`quantization.qweights`), kept as is
            self.blocks.append((first_row, src))
            self.num_rows += rows
            return
        if src.dim() != 2 or src.shape[1] != self.in_features or first_row + rows > self.out_features:
            raise CheckpointError(
                f"{what}: the checkpoint tensor has shape {tuple(src.shape)}, the model expects {rows} "
                f"rows of {self.in_features} at row {first_row} of {self.out_features}; does config.json "
                "match the weights?")
        self.blocks.append((first_row, _keepable(src, self.dtype)))
        self.num_rows += rows

    @property
    def complete(self) -> bool:
        return self.num_rows == self.out_features

    def ordered(self) -> list[tuple[int, torch.Tensor]]:
        """The blocks by first row; they must tile the weight exactly.

        Raises:
            CheckpointError: rows are missing or loaded twice.
        """
        blocks = sorted(self.blocks, key=lambda b: b[0])
        at = 0
        for first, block in blocks:
            if first != at:
                how = "loaded twice" if first < at else "missing from the checkpoint"
                raise CheckpointError(f"weight rows {min(first, at)}..{max(first, at)} of {self.out_features} are {how}")
            at += block.shape[0]
        return blocks


def _keepable(src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    src = materialize(src)
    if src.dtype == dtype and src.is_contiguous() and is_shareable(src):
        return src
    # A tensor the caller still holds is copied even where the dtype and layout already fit.
    out = src.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True)
    release_pages(src)
    return out


class DenseRows:
    """The ``"rows"`` form: the plain ``[out, in]`` weight, one product.

    Blocks that lie back to back in memory are viewed as one: an HF checkpoint stores each
    layer's tensors by name, so gate_proj and up_proj are adjacent in the file and a gated MLP's
    weight stays the file's pages. Blocks that are not (k_proj, o_proj, q_proj, v_proj) are copied
    once into one tensor, their file pages handed back: one product instead of three cost 60 us a
    layer less at one row and 110 at 32 (q/k/v of Qwen2-0.5B, AVX2, 2 threads), and the copy is
    5% of that model's weights.
    """

    def __init__(self, blocks: list[tuple[int, torch.Tensor]]):
        tensors = [w for _, w in blocks]
        self._held = tensors  # a joined view does not own its memory
        if all(_adjacent(a, b) for a, b in zip(tensors, tensors[1:])):
            self.weight = _join(tensors) if len(tensors) > 1 else tensors[0]
        else:
            self.weight = torch.cat(tensors)
            for t in tensors:
                release_pages(t)
            self._held = []
        self.dtype = self.weight.dtype

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return dense_linear(x, self.weight, bias)

    def dense(self) -> torch.Tensor:
        return self.weight

    def tensors(self) -> dict[int, int]:
        """Bytes held, by address (for counting shared tensors once)."""
        return {self.weight.data_ptr(): self.weight.nbytes}


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype == b.dtype and a.shape[1:] == b.shape[1:] and a.is_contiguous() and b.is_contiguous()
            and a.device.type == b.device.type == "cpu" and a.data_ptr() + a.nbytes == b.data_ptr())


def _join(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One tensor over back-to-back ones, viewing their memory; the caller keeps them alive."""
    first = tensors[0]
    buf = (ctypes.c_byte * sum(t.nbytes for t in tensors)).from_address(first.data_ptr())
    return torch.frombuffer(buf, dtype=first.dtype).view(-1, *first.shape[1:])


class OneDnnWeight:
    """The ``"onednn"`` form (bf16): the dense weight for one-row products, which it streams ~15%
    faster, and oneDNN's blocked copy from two rows on."""

    def __init__(self, blocks: list[tuple[int, torch.Tensor]]):
        self.weight = DenseRows(blocks).weight
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(self.weight)
        self.dtype = self.weight.dtype

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if (x.dim() == 2 and x.shape[0] > 1 and x.dtype == self.dtype
                and not cpu_kernels.gemv_supported(x, self.weight)):
            return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.blocked, bias, "none", [], "")
        return dense_linear(x, self.weight, bias)

    def dense(self) -> torch.Tensor:
        return self.weight

    def tensors(self) -> dict[int, int]:
        size = self.weight.numel() * self.weight.element_size()
        # The blocked copy may be an opaque oneDNN tensor: count it by the dense one's size.
        return {self.weight.data_ptr(): size, id(self.blocked): size}


class PackedWeight:
    """The ``"packed"`` form: ferrollm's GEMM panels (fp32).

    ``gated=True`` marks a ``[gate, up]`` projection whose output feeds ``silu(gate) * up``: each
    half is packed on its own, for `silu_and_mul`'s fused kernel.
    """

    def __init__(self, blocks: list[tuple[int, torch.Tensor]], out_features: int, in_features: int,
                 gated: bool = False):
        self.out_features, self.in_features, self.gated = out_features, in_features, gated
        self.dtype = torch.float32
        parts = 2 if gated else 1
        if out_features % parts:
            raise CheckpointError(f"a gated projection needs an even number of rows. Given: {out_features}")
        width = out_features // parts
        self.part_len = cpu_kernels.gemm_packed_len(width, in_features)
        # Zeroed: the padding columns of the last panel are never written.
        self.weight = torch.zeros(parts * self.part_len, dtype=torch.float32)
        for first, block in blocks:
            for part in range(parts):
                lo, hi = max(first, part * width), min(first + block.shape[0], (part + 1) * width)
                if lo < hi:
                    cpu_kernels.gemm_pack_rows(block[lo - first:hi - first], self._part(part), width,
                                               lo - part * width)
            release_pages(block)
        self.nbytes = self.weight.numel() * 4

    def tensors(self) -> dict[int, int]:
        return {self.weight.data_ptr(): self.nbytes}

    def _part(self, part: int) -> torch.Tensor:
        return self.weight[part * self.part_len:(part + 1) * self.part_len]

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if not self._takes(x):
            return F.linear(x, self.dense(), bias)
        if not self.gated:
            return cpu_kernels.gemm(x, self.weight, bias, self.out_features)
        width = self.out_features // 2
        halves = [None, None] if bias is None else [bias[:width], bias[width:]]
        return torch.cat([cpu_kernels.gemm(x, self._part(i), halves[i], width) for i in range(2)], dim=1)

    def silu_and_mul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """``silu(gate) * up`` of a gated pack in one kernel; None where `x` does not suit it.

        The ``[rows, 2 * width]`` product never reaches memory: a Qwen2-0.5B MLP writes and
        rereads 9728 floats per row for it, and the separate SiLU-and-mul call costs ~0.1 ms a
        layer at a 32-row decode step. Its values are bit for bit those of the two calls.
        """
        if not self.gated or not self._takes(x):
            return None
        return cpu_kernels.gemm_silu_mul(x, self.weight, bias, self.out_features // 2)

    def _takes(self, x: torch.Tensor) -> bool:
        return x.dim() == 2 and x.shape[0] >= 1 and x.dtype == self.dtype

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the plain weight, ``[*ids.shape, in_features]`` (not for gated packs)."""
        return cpu_kernels.gemm_rows(self.weight, self.out_features, self.in_features, ids)

    def dense(self) -> torch.Tensor:
        """The plain ``[out_features, in_features]`` weight, unpacked (for saving)."""
        parts = 2 if self.gated else 1
        width = self.out_features // parts
        return torch.cat([cpu_kernels.gemm_unpack(self._part(i), width, self.in_features) for i in range(parts)])


class PackedBf16Weight:
    """The ``"packed_bf16"`` form: the bf16 GEMM's panels (`kernels.cpu.gemm_bf16`), one copy,
    packed block by block as the rows arrive; products take fp32 or bf16 ``x`` and return its
    dtype, summed in fp32."""

    def __init__(self, blocks: list[tuple[int, torch.Tensor]], out_features: int, in_features: int):
        self.out_features, self.in_features = out_features, in_features
        self.dtype = torch.bfloat16
        # Zeroed: padding columns, and the odd half of the last pair of an odd `in_features`.
        self.weight = torch.zeros(gemm_bf16.packed_len(out_features, in_features), dtype=torch.bfloat16)
        for first, block in blocks:
            gemm_bf16.pack_rows(block, self.weight, out_features, first)
            release_pages(block)
        self.nbytes = self.weight.numel() * 2

    def tensors(self) -> dict[int, int]:
        return {self.weight.data_ptr(): self.nbytes}

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) and x.dim() >= 1:
            # Any leading shape (no rows included) flattens to rows; the kernel takes none.
            out = gemm_bf16.linear(x.reshape(-1, self.in_features), self.weight, bias, self.out_features)
            return out.view(*x.shape[:-1], self.out_features)
        # Unpacks the whole weight on every call: only for inputs no CPU model passes.
        return F.linear(x, self.dense().to(x.dtype), bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the plain weight, ``[*ids.shape, in_features]``."""
        return gemm_bf16.rows(self.weight, self.out_features, self.in_features, ids)

    def dense(self) -> torch.Tensor:
        """The plain ``[out_features, in_features]`` weight, unpacked (for saving)."""
        return gemm_bf16.unpack(self.weight, self.out_features, self.in_features)


CpuWeight = DenseRows | OneDnnWeight | PackedBf16Weight | PackedWeight


def build_cpu_weight(form: str, blocks: list[tuple[int, torch.Tensor]], out_features: int, in_features: int,
                     gated: bool = False) -> CpuWeight:
    """The ``form`` of an ``[out_features, in_features]`` weight from its row blocks (which must
    tile it: `RowBlocks.ordered`)."""
    if form == "packed":
        return PackedWeight(blocks, out_features, in_features, gated=gated)
    if form == "packed_bf16":
        return PackedBf16Weight(blocks, out_features, in_features)
    if form == "onednn":
        return OneDnnWeight(blocks)
    return DenseRows(blocks)


def release_pages(t: torch.Tensor) -> None:
    """Hands back the pages of a checkpoint file that ``t`` views, once its bytes were copied or
    packed elsewhere, so they stop counting in this process's memory (they stay in the page
    cache, and read back the same bytes if touched again: the mapping is private and never
    written). Acts only where the kernel's own map (/proc/self/maps) says the whole range is
    mapped from a checkpoint file; does nothing for any other tensor, or off Linux."""
    if t.device.type != "cpu" or _libc() is None or t.numel() == 0:
        return
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-start // _PAGE_SIZE) * _PAGE_SIZE, end // _PAGE_SIZE * _PAGE_SIZE
    if last > first and any(lo <= start and end <= hi for lo, hi in checkpoint_mappings()):
        _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED)


_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_MADV_DONTNEED = 4  # Linux
_CHECKPOINT_SUFFIXES = (".safetensors", ".gguf")


def checkpoint_mappings() -> list[tuple[int, int]]:
    """Address ranges this process maps from checkpoint files now."""
    ranges = []
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].rstrip().endswith(_CHECKPOINT_SUFFIXES):
                lo, hi = fields[0].split("-")
                ranges.append((int(lo, 16), int(hi, 16)))
    return ranges


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return None
