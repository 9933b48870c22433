"""ferrollm's fp32 GEMM beside oneDNN's packed GEMM on a Qwen2-0.5B-shaped decode step's matmuls.

Each engine gets its own 24 layers of packed weights (qkv 1152×896, o 896×896, gate/up 9728×896,
down 896×4864), cycled so that every call finds its weight cold, as in a real step; then the
151936×896 LM head. Prints, per row count, milliseconds per step and GFLOP/s for each. glibc keeps
freed memory as in the engine (`worker/cpu_allocator.py`): without it, an output over glibc's
32 MB mmap threshold (the LM head's from 64 rows on) is fresh, page-faulting memory every call.

    python benches/cpu_gemm.py [--rows 2,8,32,64] [--threads 2]
"""

from __future__ import annotations

import argparse
import time

import torch

from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.worker.cpu_allocator import keep_freed_memory

LAYER_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]
LM_HEAD = (151936, 896)
LAYERS = 24


def _onednn(weight: torch.Tensor):
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _ferrollm(weight: torch.Tensor):
    packed = cpu_kernels.gemm_pack(weight)
    return lambda x: cpu_kernels.gemm(x, packed, None, weight.shape[0])


def _step_seconds(layers, xs, repeats: int = 2) -> float:
    """Best of `repeats` passes over every layer's products, after one warm-up pass."""
    best = float("inf")
    for rep in range(repeats + 1):
        start = time.perf_counter()
        for layer in layers:
            for product, x in zip(layer, xs):
                product(x)
        if rep:
            best = min(best, time.perf_counter() - start)
    return best


def _lm_head_seconds(product, x, repeats: int = 3) -> float:
    product(x)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        product(x)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2,8,32,64")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    if not cpu_kernels.gemm_supported(torch.empty(1, 1)):
        raise SystemExit("ferrollm's GEMM does not run here (it needs AVX-512 and torch's OpenMP team)")
    engines = {"ferrollm": _ferrollm, "onednn": _onednn}
    weights = [[torch.randn(n, k) for n, k in LAYER_SHAPES] for _ in range(LAYERS)]
    layers = {name: [[make(w) for w in layer] for layer in weights] for name, make in engines.items()}
    head = torch.randn(*LM_HEAD)
    heads = {name: make(head) for name, make in engines.items()}
    layer_flops = 2 * LAYERS * sum(n * k for n, k in LAYER_SHAPES)
    head_flops = 2 * LM_HEAD[0] * LM_HEAD[1]
    print(f"{'rows':>5} {'engine':>9} {'layers ms':>10} {'GFLOP/s':>8} {'LM head ms':>11} {'GFLOP/s':>8}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k) for _, k in LAYER_SHAPES]
        x_head = torch.randn(rows, LM_HEAD[1])
        for name in engines:
            step = _step_seconds(layers[name], xs)
            lm = _lm_head_seconds(heads[name], x_head)
            print(f"{rows:>5} {name:>9} {step * 1e3:>10.1f} {rows * layer_flops / step / 1e9:>8.0f} "
                  f"{lm * 1e3:>11.1f} {rows * head_flops / lm / 1e9:>8.0f}")


if __name__ == "__main__":
    main()
