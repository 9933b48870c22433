"""Split-K for the quantized matmuls at decode: how many K ranges a launch splits into, the range
each program walks, and the reduction of the float32 partial sums.

Why: a decode batch is one row tile, so a ``[1, K] x [K, 2048]`` product launches only
2048 / BLOCK_N = 32 programs, and on a 132-SM GPU most SMs idle while each program streams a
whole ``K x 64`` slice of the weight. Splitting K over a third grid axis multiplies the programs
until they fill one wave; each program writes its scaled float32 partial to
``partials[split, rows, out]`` and :func:`reduce_split_k` adds them, the bias and rounds once.

Invariants: ranges hold whole BLOCK_K tiles, so a tile never straddles a scale group or block
(the kernels choose BLOCK_K dividing the group), and every split is non-empty, so ``partials``
needs no zeroing. The plan depends on shapes alone (never on tensor values) and the partials come
from torch's allocator, so a split launch captures in a CUDA graph like an unsplit one.

Costs: ``4 * split * rows * out`` bytes of partials written and read back (about 32 KiB for one
row of a 2048-wide projection split 4 ways, against its 4 MiB int8 weight), and one more launch.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from ferrollm.kernels.triton.quant._common import launch_config, matmul_grid

# The SM count assumed where the device has none (CPU tensors under TRITON_INTERPRET=1): an H100
# SXM's and an H200's, so the interpreter runs the plan that decode takes on those GPUs and the
# CPU tests cover the split path.
INTERPRETER_NUM_SMS = 132
_REDUCE_BLOCK_N = 256


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """The streaming multiprocessors of ``device`` (a documented stand-in off CUDA)."""
    if device.type != "cuda":
        return INTERPRETER_NUM_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def choose_split_k(rows: int, out_features: int, in_features: int, block_k: int, sms: int) -> int:
    """The split factor the matmuls pick on their own: 1 unless the small-row (decode) tiles
    leave at least half the SMs idle; then as many K ranges as keep the programs within one wave
    of ``sms`` (a second wave would add a tail), at most one per K tile.

    Large-row launches already fill the GPU with row tiles and keep their 2-D grid.
    """
    config = launch_config(rows, block_k)
    if config["BLOCK_M"] > 64:
        return 1
    row_blocks, col_blocks = matmul_grid(rows, out_features, config)
    programs = row_blocks * col_blocks
    if 2 * programs > sms:
        return 1
    return max(1, min(sms // programs, triton.cdiv(in_features, block_k)))


def split_k_for(split_k: int | None, rows: int, out_features: int, in_features: int, block_k: int,
                device: torch.device) -> int:
    """The caller's ``split_k`` (capped at one range per K tile), else :func:`choose_split_k`'s."""
    if split_k is None:
        return choose_split_k(rows, out_features, in_features, block_k, num_sms(device))
    if not isinstance(split_k, int) or split_k < 1:
        raise ValueError(f"`split_k` must be None or an int >= 1. Given: {split_k!r}")
    return min(split_k, triton.cdiv(in_features, block_k))


@dataclasses.dataclass(frozen=True)
class SplitPlan:
    """One matmul launch's split: its 3-D grid, and the ``[splits, rows, out]`` float32 partial
    sums the programs write instead of the output when K is split (``None`` unsplit).

    The kernels take ``plan.target(out_rows)`` as their partials pointer and ``SPLIT=plan.split``,
    and the caller ends with ``plan.finish(out_rows, bias)``."""

    grid: tuple[int, int, int]
    partials: torch.Tensor | None

    @property
    def split(self) -> bool:
        return self.partials is not None

    def target(self, out_rows: torch.Tensor) -> torch.Tensor:
        """Where the programs store: the partials when split (``out_rows``, unread, otherwise)."""
        return out_rows if self.partials is None else self.partials

    def finish(self, out_rows: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Sums a split launch's partials into ``out_rows`` (with ``bias``); nothing unsplit."""
        if self.partials is not None:
            reduce_split_k(self.partials, out_rows, bias)


def plan_split(split_k: int | None, rows: int, out_features: int, in_features: int, block_k: int,
               config: dict, device: torch.device) -> SplitPlan:
    """The launch plan of a ``[rows, in] x [in, out]`` matmul with ``config``'s tiles:
    :func:`split_k_for`'s split and, when it splits, fresh partials."""
    num_splits = split_k_for(split_k, rows, out_features, in_features, block_k, device)
    partials = None if num_splits == 1 else torch.empty((num_splits, rows, out_features), dtype=torch.float32,
                                                        device=device)
    return SplitPlan((*matmul_grid(rows, out_features, config), num_splits), partials)


@triton.jit
def split_k_range(K, BLOCK_K: tl.constexpr):
    """``[lo, hi)``, the K range of this program's split (grid axis 2): whole BLOCK_K tiles, the
    splits differing by at most one tile; one split covers every tile (the last one masked)."""
    num_tiles = tl.cdiv(K, BLOCK_K)
    split, num_splits = tl.program_id(2), tl.num_programs(2)
    return split * num_tiles // num_splits * BLOCK_K, (split + 1) * num_tiles // num_splits * BLOCK_K


@triton.jit
def store_tile(out_ptr, partials_ptr, bias_ptr, acc, offs_m, offs_n, M, N, stride_om,
               HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr):
    """Stores a scaled float32 tile: with ``SPLIT``, as this split's partial (bias and rounding
    wait for :func:`reduce_split_k`); else as the output, bias added and rounded once."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        rows = (tl.program_id(2) * M + offs_m).to(tl.int64)
        tl.store(partials_ptr + rows[:, None] * N + offs_n[None, :], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        out = out_ptr + offs_m.to(tl.int64)[:, None] * stride_om + offs_n[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_kernel(out_ptr, partials_ptr, bias_ptr, M, N, num_splits, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr):
    m = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    acc = tl.zeros([BLOCK_N], tl.float32)
    for split in range(num_splits):
        acc += tl.load(partials_ptr + (split * M + m).to(tl.int64) * N + offs_n, mask=mask_n, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + m.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=mask_n)


def reduce_split_k(partials: torch.Tensor, out_rows: torch.Tensor, bias: torch.Tensor | None) -> None:
    """``out_rows = partials.sum(0) + bias``, rounded once to ``out_rows``' dtype.

    A Triton kernel rather than torch ops: one launch where torch takes three (sum, bias add,
    cast into ``out_rows``), which counts at decode; the splits are summed in a fixed order
    (no atomics), so results repeat run to run; and the float32 sum, float32 bias and single
    rounding are the unsplit epilogue's.
    """
    num_splits, rows, out_features = partials.shape
    _reduce_kernel[(rows, triton.cdiv(out_features, _REDUCE_BLOCK_N))](
        out_rows, partials, partials if bias is None else bias, rows, out_features, num_splits,
        out_rows.stride(0), HAS_BIAS=bias is not None, BLOCK_N=_REDUCE_BLOCK_N,
    )
