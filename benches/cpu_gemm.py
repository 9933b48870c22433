"""ferrollm's GEMMs beside oneDNN's (and torch's) on a Qwen2-0.5B-shaped decode step's matmuls.

Each engine gets its own 24 layers of packed weights (qkv 1152×896, o 896×896, gate/up 9728×896,
down 896×4864), cycled so that every call finds its weight cold, as in a real step; then the
151936×896 LM head. Prints, per row count, milliseconds per step and GFLOP/s for each. glibc keeps
freed memory as in the engine (`worker/cpu_allocator.py`): without it, an output over glibc's
32 MB mmap threshold (the LM head's from 64 rows on) is fresh, page-faulting memory every call.

``--dtype bfloat16`` compares ferrollm's bf16 GEMM (`kernels.cpu.gemm_bf16`, bf16 activations)
with torch's bf16 `F.linear` on the plain weight, oneDNN's blocked bf16 GEMM where oneDNN runs
bf16 (AVX512-BF16, AMX), and oneDNN's fp32 GEMM on the same values; ``--bf16-loops amx,avx512_bf16``
adds a row for each of ferrollm's bf16 loops named (those the CPU runs). ``--clock cpu`` times with
the process's CPU time instead of the wall clock: on a shared, loaded machine that leaves out the
time other processes held the cores (meaningful with ``--threads 1``).

    python benches/cpu_gemm.py [--rows 2,8,32,64] [--threads 2] [--dtype bfloat16] [--layers 24]
                               [--bf16-loops amx,avx512_bf16,avx512]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.nn.functional as F
from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.kernels.cpu import gemm_bf16
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


def _ferrollm_bf16(weight: torch.Tensor, loop: str | None = None):
    packed = gemm_bf16.pack(weight.bfloat16())
    return lambda x: gemm_bf16.linear(x, packed, None, weight.shape[0], loop)


def _torch_bf16(weight: torch.Tensor):
    plain = weight.bfloat16()
    return lambda x: F.linear(x, plain)


def _onednn_fp32(weight: torch.Tensor):
    product = _onednn(weight.float())
    return lambda x: product(x.float())


def _engines(dtype: torch.dtype, bf16_loops: list[str]) -> dict:
    if dtype == torch.float32:
        if not cpu_kernels.gemm_supported(torch.empty(1, 1)):
            raise SystemExit("ferrollm's fp32 GEMM does not run here (it needs AVX-512 and torch's OpenMP team)")
        return {"ferrollm": _ferrollm, "onednn": _onednn}
    engines = {"ferrollm": _ferrollm_bf16, "torch": _torch_bf16}
    best = gemm_bf16.KERNELS.index(gemm_bf16.kernel())
    for loop in bf16_loops:
        if gemm_bf16.KERNELS.index(loop) <= best:
            engines[f"f-{loop}"] = lambda w, loop=loop: _ferrollm_bf16(w, loop)
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        engines["onednn"] = lambda w: _onednn(w.bfloat16())
    engines["onednn-f32"] = _onednn_fp32
    return engines


CLOCK = time.perf_counter


def _step_seconds(layers, xs, repeats: int = 2) -> float:
    """Best of `repeats` passes over every layer's products, after one warm-up pass."""
    best = float("inf")
    for rep in range(repeats + 1):
        start = CLOCK()
        for layer in layers:
            for product, x in zip(layer, xs):
                product(x)
        if rep:
            best = min(best, CLOCK() - start)
    return best


def _lm_head_seconds(product, x, repeats: int = 3) -> float:
    product(x)
    best = float("inf")
    for _ in range(repeats):
        start = CLOCK()
        product(x)
        best = min(best, CLOCK() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="2,8,32,64")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    parser.add_argument("--bf16-loops", default="", help="ferrollm bf16 loops to time each, e.g. amx,avx512_bf16")
    args = parser.parse_args()
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    dtype = getattr(torch, args.dtype)
    engines = _engines(dtype, [loop for loop in args.bf16_loops.split(",") if loop])
    if dtype == torch.bfloat16:
        print(f"ferrollm's bf16 kernel here: {gemm_bf16.kernel()}; loadavg {os.getloadavg()}")
    # bf16 values throughout, so every engine multiplies the same numbers.
    weights = [[torch.randn(n, k).to(dtype) for n, k in LAYER_SHAPES] for _ in range(args.layers)]
    layers = {name: [[make(w) for w in layer] for layer in weights] for name, make in engines.items()}
    head = torch.randn(*LM_HEAD).to(dtype)
    heads = {name: make(head) for name, make in engines.items()}
    layer_flops = 2 * args.layers * sum(n * k for n, k in LAYER_SHAPES)
    head_flops = 2 * LM_HEAD[0] * LM_HEAD[1]
    print(f"{'rows':>5} {'engine':>14} {'layers ms':>10} {'GFLOP/s':>8} {'LM head ms':>11} {'GFLOP/s':>8}")
    for rows in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(rows, k).to(dtype) for _, k in LAYER_SHAPES]
        x_head = torch.randn(rows, LM_HEAD[1]).to(dtype)
        for name in engines:
            step = _step_seconds(layers[name], xs)
            lm = _lm_head_seconds(heads[name], x_head)
            print(f"{rows:>5} {name:>14} {step * 1e3:>10.1f} {rows * layer_flops / step / 1e9:>8.0f} "
                  f"{lm * 1e3:>11.1f} {rows * head_flops / lm / 1e9:>8.0f}")


if __name__ == "__main__":
    main()
