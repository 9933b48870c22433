"""The quantized CPU linear layers (``ferrollm.kernels.cpu.quant``) against the machine's streaming
bandwidth at one row, and against ferrollm's fp32 path at batch sizes, on Qwen2-0.5B's layer shapes.

Each format gets its own ``--layers`` layers of weights (qkv 1152x896, o 896x896, gate/up
9728x896, down 896x4864), cycled so that every call finds its weight cold, as in a real step.
Printed, in one run:

- the streaming read bandwidth: a sum over a 512 MB tensor, and ferrollm's fp32 GEMV over the
  fp32 layers (the kernel a batch-1 fp32 step runs);
- per format, at one row, GB/s of weight bytes (stored values + scales + mins) and its share of
  the best streaming figure;
- per format, at 32 and 128 rows, rows/s next to the fp32 path on the same shapes (ferrollm's
  GEMM where it runs, AVX-512; else ``layers.cpu_weights.dense_linear``: oneDNN on the plain
  weight).

    python benches/quant_gemm.py [--layers 8] [--threads 2] [--rows 32,128]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.kernels.cpu import quant
from ferrollm.model_executor.layers.cpu_weights import dense_linear

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_gemm import _step_seconds  # noqa: E402  (the fp32 benchmark's timing loop)

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]


def _int4(group_size: int, asym: bool):
    def make(n: int, k: int):
        q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
        scales = torch.rand(n, k // group_size) * 0.01
        mins = -8 * scales if asym else None
        packed = quant.pack_int4(q)
        size = packed.numel() + 4 * scales.numel() * (2 if asym else 1)
        return (lambda x: quant.wq_linear(x, packed, scales, mins, 4, group_size)), size
    return make


def _int8(group_size: int | None):
    def make(n: int, k: int):
        q = torch.randint(-128, 128, (n, k), dtype=torch.int8)
        group = group_size or k
        scales = torch.rand(n, k // group) * 0.01
        return (lambda x: quant.wq_linear(x, q, scales, None, 8, group)), q.numel() + 4 * scales.numel()
    return make


def _w8a8(n: int, k: int):
    packed = quant.w8a8_pack(torch.randint(-128, 128, (n, k), dtype=torch.int8))
    scale = torch.rand(n) * 0.01
    return (lambda x: quant.w8a8_linear(x, packed, scale)), packed.numel() + 4 * n


def _fp8(input_quant: str, block: tuple[int, int] | None):
    def make(n: int, k: int):
        w8 = (torch.randn(n, k) * 40).to(torch.float8_e4m3fn).view(torch.uint8)
        scale = torch.rand(-(-n // block[0]), -(-k // block[1])) * 0.01 if block else torch.tensor(0.01)
        return (lambda x: quant.fp8_linear(x, w8, scale, None, block, input_quant)), w8.numel() + 4 * scale.numel()
    return make


def _fp32(n: int, k: int):
    w = torch.randn(n, k)
    if cpu_kernels.gemm_supported(w):
        packed = cpu_kernels.gemm_pack(w)

        def product(x):
            if x.shape[0] <= cpu_kernels.GEMV_MAX_ROWS:
                return cpu_kernels.gemv(x, w)
            return cpu_kernels.gemm(x, packed, None, n)
        return product, 4 * w.numel()
    return (lambda x: dense_linear(x, w, None)), 4 * w.numel()


FORMATS = {
    "fp32": _fp32,
    "int4 g32": _int4(32, False),
    "int4 g128 mins": _int4(128, True),
    "int8 g128": _int8(128),
    "int8 channel": _int8(None),
    "w8a8 dynamic": _w8a8,
    "fp8 weight-only": _fp8("none", None),
    "fp8 dynamic": _fp8("tensor", None),
    "fp8 block group": _fp8("group", (128, 128)),
}


def _seconds(layers, rows: int, repeats: int) -> float:
    """Best of `repeats` passes over every layer's products (after one warm-up pass)."""
    return _step_seconds(layers, [torch.randn(rows, k) for _, k in SHAPES], repeats)


def _sum_bandwidth(repeats: int = 5) -> float:
    big = torch.ones(128 * 1024 * 1024)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        big.sum()
        best = min(best, time.perf_counter() - start)
    return big.numel() * 4 / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", default="32,128")
    parser.add_argument("--formats", default=",".join(FORMATS))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    names = args.formats.split(",")
    built = {}
    for name in names:
        layers = [[FORMATS[name](n, k) for n, k in SHAPES] for _ in range(args.layers)]
        built[name] = ([[p for p, _ in layer] for layer in layers], sum(s for layer in layers for _, s in layer))
    stream = _sum_bandwidth()
    print(f"streaming read: sum over 512 MB {stream:.1f} GB/s")
    one_row = {}
    for name, (layers, size) in built.items():
        one_row[name] = size / _seconds(layers, 1, 5) / 1e9
    if "fp32" in one_row:
        print(f"streaming read: fp32 GEMV over {args.layers} layers {one_row['fp32']:.1f} GB/s")
        stream = max(stream, one_row["fp32"])
    print(f"\n{'format':>16} {'MB':>7} {'1 row GB/s':>11} {'of stream':>9}", end="")
    rows = [int(r) for r in args.rows.split(",")]
    print("".join(f" {f'{r} rows/s':>12} {'x fp32':>6}" for r in rows))
    per_rows = {r: {name: r / _seconds(layers, r, 2) for name, (layers, _) in built.items()} for r in rows}
    for name, (_, size) in built.items():
        line = f"{name:>16} {size / 1e6:7.0f} {one_row[name]:11.1f} {one_row[name] / stream:9.0%}"
        for r in rows:
            speed = per_rows[r][name]
            ratio = speed / per_rows[r]["fp32"] if "fp32" in per_rows[r] else float("nan")
            line += f" {speed:12.0f} {ratio:6.2f}"
        print(line)


if __name__ == "__main__":
    main()
