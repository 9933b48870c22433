"""The CPU matmul path: every linear layer's weight packed once, after loading.

PyTorch's `F.linear` goes to MKL, which streams weights slowly when few rows multiply them, the
decode case. So on the CPU every linear layer runs through a packed weight; `FERROLLM_CPU_ONEDNN=0`
turns this off.

- **fp32 on AVX-512 CPUs: ferrollm's GEMM** (`cpu_kernels.gemm`, `rust/kernels/src/gemm.rs`), the
  weight in 48-column panels. On the 2-core development machine (Zen 4, 2 threads, weights cold as
  in a real step) a Qwen2-0.5B-shaped 32-row decode step's layer matmuls take 116-150 ms against
  140-169 through oneDNN, its LM head 40-45 against 47-54 ms; and the 32 x 128/128 workload went
  from 159-170 to 186 total tokens/s.
- **Elsewhere, and for bf16: oneDNN**, `mkldnn::_linear_pointwise` (what inductor's CPU freezing
  pass emits) on a weight packed by `mkldnn::_reorder_linear_weight`: dense activations in and
  out, so no `to_mkldnn`/`to_dense` copies per call (those were ~15% of a profiled 32×128 run).
  Against MKL, a [9728, 896] gate/up weight at 1 row took 1.2 ms instead of 2.8, at 8 rows 2.9
  instead of 4.9; at 512 rows they tie. bf16 takes it wherever oneDNN runs bf16 (AVX-512 CPUs;
  natively with AVX512-BF16 or AMX): on the development machine, which has AVX512-BF16, packed
  bf16 doubles the 32-row decode matmuls against fp32.

The packed copy sits beside the dense weight, which stays for oneDNN's one-row products (see
`linear`), embeddings tied to the LM head, checkpoint saving and tensor-parallel loading. With
ferrollm's GEMM the forward pass never reads the dense weight: one row streams the panels about
as fast as the dense rows.

Where oneDNN packed the weight (bf16, CPUs without AVX-512), products of one or two rows, the
decode steps of small batches, go to neither: they are bound by reading the weight, which
`ferrollm.cpu_kernels.gemv` streams at ~28 GB/s where oneDNN reaches ~20 (see `rust/kernels`).
A Qwen2-0.5B-shaped batch-1 step spends 97 products and ~85% of its time in them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeGuard

import torch
import torch.nn.functional as F
from torch import nn

from ferrollm import cpu_kernels

__all__ = ["MLP_SLAB_ROWS", "PackedWeight", "linear", "onednn_enabled", "pack_linear_weights", "row_slabs",
           "silu_and_mul_linear"]

# Rows per slab of a long prefill's MLP on the CPU. A 4096-row Qwen2-0.5B MLP (gate/up 9728 wide,
# then SiLU-and-mul, then down) writes and rereads a 160 MB intermediate that no cache holds, and
# oneDNN's gate/up GEMM falls to ~188 GFLOP/s against ~219 at 512 rows. In 256-row slabs the
# intermediates stay in the L3: 540 ms a layer against 690-760 whole (fp32, 2 threads; 128 rows:
# 560-590, 512: 560-590).
MLP_SLAB_ROWS = 256


def onednn_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether layers on `device` in `dtype` should use packed oneDNN weights."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    if os.environ.get("FERROLLM_CPU_ONEDNN", "1") == "0":
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class PackedWeight:
    """A weight (and bias) packed once for the CPU's matrix products: in fp32 on AVX-512 CPUs, the
    panels of ferrollm's own GEMM (`cpu_kernels.gemm`), else oneDNN's blocked layout.

    `gated=True` marks a `[gate, up]` projection whose output feeds `silu(gate) * up`: ferrollm's
    GEMM then packs each half on its own, for `silu_and_mul_linear`'s fused kernel.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, gated: bool = False):
        self.dtype = weight.dtype
        self.out_features = weight.shape[0]
        self.own_gemm = cpu_kernels.gemm_supported(weight)
        self.gated = gated and self.own_gemm
        if self.own_gemm:
            self.weight = cpu_kernels.gemm_pack(weight, parts=2 if self.gated else 1)
        else:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach().contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """`x @ weight.T + bias`: ferrollm's GEMM wherever it packed the weight, else the streaming
    GEMV for one or two rows, else oneDNN's packed GEMM."""
    # One row streams the GEMM's panels about as fast as the GEMV streams the dense weight, or
    # faster (a Qwen2-0.5B-shaped batch-1 step, cold weights, 2 threads, five runs: 25.3-40.9
    # against 26.5-36.8 GB/s); two rows, faster (25.9/35.4/19.0 against 21.5/29.5/18.3).
    if _own_gemm_takes(packed, x):
        if packed.gated:
            return torch.cat([cpu_kernels.gemm(x, w, b, n) for w, b, n in _halves(packed)], dim=1)
        return cpu_kernels.gemm(x, packed.weight, packed.bias, packed.out_features)
    if cpu_kernels.gemv_supported(x, weight):
        return cpu_kernels.gemv(x, weight, bias)
    if packed is None or x.dim() != 2 or x.shape[0] == 0 or x.dtype != packed.dtype:
        return F.linear(x, weight, bias)
    # One row is a matrix-vector product, bound by reading the weight: oneDNN streams the plain
    # row-major weight ~15% faster than its blocked layout (25 vs 22 GB/s for the [9728, 896]
    # gate/up, 29 vs 26 GB/s for the LM head, cold caches). From two rows on, blocked wins.
    weight = weight if x.shape[0] == 1 else packed.weight
    return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, packed.bias, "none", [], "")


def silu_and_mul_linear(x: torch.Tensor, packed: PackedWeight | None) -> torch.Tensor | None:
    """`silu(gate) * up` of `[gate, up] = x @ weight.T + bias` in one kernel where `packed` is a
    gated pack of ferrollm's GEMM and `x` suits it; None where the caller must take `linear`
    and the activation apart.

    The `[rows, 2 * width]` product never reaches memory: a Qwen2-0.5B MLP writes and rereads
    9728 floats per row for it, and the separate SiLU-and-mul call costs ~0.1 ms a layer at a
    32-row decode step. Its values are bit for bit those of the two calls.
    """
    if not _own_gemm_takes(packed, x) or not packed.gated:
        return None
    return cpu_kernels.gemm_silu_mul(x, packed.weight, packed.bias, packed.out_features // 2)


def _own_gemm_takes(packed: PackedWeight | None, x: torch.Tensor) -> TypeGuard[PackedWeight]:
    """Whether ferrollm's GEMM packed the weight and takes `x`: rows of its dtype, at least one."""
    return (packed is not None and packed.own_gemm and x.dim() == 2 and x.shape[0] >= 1
            and x.dtype == packed.dtype)


def _halves(packed: PackedWeight) -> list[tuple[torch.Tensor, torch.Tensor | None, int]]:
    """A gated pack's `(packed weight, bias, out_features)` for the gate, then for the up half."""
    width = packed.out_features // 2
    size = len(packed.weight) // 2
    bias = [None, None] if packed.bias is None else [packed.bias[:width], packed.bias[width:]]
    return [(packed.weight[:size], bias[0], width), (packed.weight[size:], bias[1], width)]


def row_slabs(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int) -> torch.Tensor:
    """`fn(x)` for a row-wise `fn` that keeps the width, `rows` rows of `x` at a time."""
    if x.shape[0] <= rows:
        return fn(x)
    out = torch.empty_like(x)
    for start in range(0, x.shape[0], rows):
        out[start:start + rows] = fn(x[start:start + rows])
    return out


def pack_linear_weights(model: nn.Module) -> int:
    """Packs every layer that supports it (those with a `pack_for_cpu` method); returns how many."""
    count = 0
    for module in model.modules():
        pack = getattr(module, "pack_for_cpu", None)
        if callable(pack):
            pack()
            count += 1
    return count
