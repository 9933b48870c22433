"""Running a long prefill's MLP in row slabs on the CPU (the weights' own forms are in
`cpu_weights`)."""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["MLP_SLAB_ROWS", "row_slabs"]

# Rows per slab of a long prefill's MLP on the CPU. A 4096-row Qwen2-0.5B MLP (gate/up 9728 wide,
# then SiLU-and-mul, then down) writes and rereads a 160 MB intermediate that no cache holds, and
# oneDNN's gate/up GEMM falls to ~188 GFLOP/s against ~219 at 512 rows. In 256-row slabs the
# intermediates stay in the L3: 540 ms a layer against 690-760 whole (fp32, 2 threads; 128 rows:
# 560-590, 512: 560-590).
MLP_SLAB_ROWS = 256


# Rows the Rust GEMM's micro-kernel takes at once: slabs are cut at multiples of it.
GEMM_ROW_BLOCK = 8


def row_slabs(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    """`fn(x)` for a row-wise `fn` that keeps the width, in as few slabs of at most `rows` rows as
    fit, each the same whole number of GEMM row blocks but the last. Cut at `rows` every time, a
    266-row step (two colliding prompts and the running decode rows) would end in a 10-row slab
    whose MLP reads every MLP weight again for a few rows' work; 136 and 130 read them as often
    and stay compute-bound."""
    total = x.shape[0]
    if total <= rows:
        return fn(x)
    count = -(-total // rows)
    size = min(rows, _round_up(-(-total // count), GEMM_ROW_BLOCK))
    out = torch.empty_like(x)
    for start in range(0, total, size):
        out[start:start + size] = fn(x[start:start + size])
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
