"""GGUF block products (`gguf_linear`) against the machine's streaming bandwidth, in one run.

For each GGML type and each Qwen2-0.5B-shaped weight (gate/up 4864×896, down 896×4864, LM head
151936×896) and SmolLM2-135M's small ones, enough copies of the weight to exceed the last-level cache are cycled, so every
call reads its weight from memory as a decode step does. Prints:

- batch 1: GB/s of weight bytes, and that as a share of the bandwidth bound, which is
  ferrollm's fp32 GEMV streaming the same shapes' fp32 weights in the same run;
- 32 rows: rows/s, beside ferrollm's fp32 path on the dense weight (its packed GEMM where the
  CPU has AVX-512, else torch's oneDNN linear).

Weights are random blocks with finite scales (speed does not depend on the values).

With ``--layout engine`` (the default) Q4_0, Q4_1 and Q8_0 are re-laid in row groups where the
engine does so (AVX512-VNNI); ``--layout file`` reads every type in the file's layout.

    python benches/gguf_gemv.py [--types Q4_0,Q8_0] [--shapes down,smol-down] [--threads 2] [--rows 32]
        [--layout engine|file]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.kernels.cpu.gguf import (dequantize, gguf_linear, interleave, interleave_preferred,
                                       gguf_linear_stacked as gguf_stacked)

SHAPES = {"gate/up": (4864, 896), "down": (896, 4864), "lm_head": (151936, 896),
          # SmolLM2-135M's: decode there is many small products back to back.
          "smol-qkv": (960, 576), "smol-gate/up": (3072, 576), "smol-down": (576, 1536)}
TYPES = ["Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K", "Q5_K", "Q5_0", "Q5_1"]
# Bytes of weights cycled per shape: several times a 16-32 MB last-level cache.
CYCLED_BYTES = 192 << 20
# Byte offsets of each block's f16 scales; random bytes there could be infinite or NaN.
SCALES = {"Q4_0": (0,), "Q5_0": (0,), "Q8_0": (0,), "Q4_1": (0, 2), "Q5_1": (0, 2), "Q4_K": (0, 2),
          "Q5_K": (0, 2), "Q6_K": (208,)}


def _blocks(name: str, out_features: int, in_features: int, rng: np.random.Generator) -> np.ndarray:
    block_len, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    data = rng.integers(0, 256, size=(out_features, in_features // block_len, block_bytes), dtype=np.uint8)
    for at in SCALES[name]:
        data[..., at + 1] &= 0x1f
    return data.reshape(out_features, -1)


def _seconds_per_call(calls, repeats: int) -> float:
    """Best of `repeats` passes (after a warm-up pass) of one pass's time per call: on a shared
    machine a pass that lost a thread to another process for a time slice says nothing of the
    kernel (medians of two-thread runs there swung 5x between runs)."""
    times = []
    for rep in range(repeats + 1):
        start = time.perf_counter()
        for call in calls:
            call()
        if rep:
            times.append((time.perf_counter() - start) / len(calls))
    return min(times)


def _copies(nbytes: int) -> int:
    return max(1, -(-CYCLED_BYTES // nbytes))


def _bandwidth(shape, repeats: int) -> float:
    """GB/s of ferrollm's fp32 GEMV over cycled fp32 weights of `shape` (the streaming bound)."""
    weights = [torch.randn(shape) for _ in range(_copies(shape[0] * shape[1] * 4))]
    x = torch.randn(1, shape[1])
    seconds = _seconds_per_call([lambda w=w: cpu_kernels.gemv(x, w) for w in weights], repeats)
    return shape[0] * shape[1] * 4 / seconds / 1e9


def _fp32_rows_per_second(shape, rows: int, repeats: int) -> float:
    weight = torch.randn(shape)
    x = torch.randn(rows, shape[1])
    if cpu_kernels.gemm_supported(weight):
        packed = cpu_kernels.gemm_pack(weight)
        call = lambda: cpu_kernels.gemm(x, packed, None, shape[0])  # noqa: E731
    else:
        call = lambda: torch.nn.functional.linear(x, weight)  # noqa: E731
    return rows / _seconds_per_call([call] * 4, repeats)


def _type_row(name: str, shape, bound: float, rows: int, repeats: int, rng, layout: str) -> str:
    qtype = int(GGMLQuantizationType[name])
    block_len = GGML_QUANT_SIZES[GGMLQuantizationType[name]][0]
    if shape[1] % block_len:
        # Qwen2-0.5B's 896 is 3.5 K super-blocks: llama.cpp stores such tensors as other types.
        return f"{name:5s} {shape[0]:>6d}x{shape[1]:<5d} n/a: in_features is not a multiple of {block_len}"
    first = _blocks(name, *shape, rng)
    weights = [torch.from_numpy(first)] + [
        torch.from_numpy(_blocks(name, *shape, rng)) for _ in range(_copies(first.nbytes) - 1)]
    x1, xn = torch.randn(1, shape[1]), torch.randn(rows, shape[1])
    if layout == "engine" and interleave_preferred(qtype):
        # As the engine holds them on this CPU: re-laid in groups of rows at load.
        weights = [interleave(w, qtype, shape[1]) for w in weights]
        linear = lambda x, w: gguf_stacked(x, [w], shape[1])  # noqa: E731
    else:
        linear = lambda x, w: gguf_linear(x, w, qtype, shape[1])  # noqa: E731
    one = _seconds_per_call([lambda w=w: linear(x1, w) for w in weights], repeats)
    many = _seconds_per_call([lambda w=w: linear(xn, w) for w in weights[:4]], repeats)
    gbps = first.nbytes / one / 1e9
    # A sanity check that the weights are what the kernel read: decode one and compare.
    dense = dequantize(first, qtype, shape)
    assert torch.allclose(linear(x1, weights[0]), x1 @ dense.T, rtol=0.05, atol=0.05 * float(
        (x1.abs() @ dense.abs().T).max()))
    return (f"{name:5s} {shape[0]:>6d}x{shape[1]:<5d} {first.nbytes / 2**20:7.1f} MiB  {one * 1e3:7.3f} ms "
            f"{gbps:6.1f} GB/s {100 * gbps / bound:5.0f}%   {rows / many:9.0f} rows/s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--layout", choices=("engine", "file"), default="engine",
                        help="engine: Q4_0/Q4_1/Q8_0 re-laid as the engine holds them on this CPU; "
                             "file: every type read in the file's layout")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    with open("/proc/loadavg", encoding="utf-8") as load:
        print(f"threads {args.threads}, loadavg {load.read().split()[:3]}")
    for shape_name in args.shapes.split(","):
        shape = SHAPES[shape_name]
        bound = _bandwidth(shape, args.repeats)
        fp32 = _fp32_rows_per_second(shape, args.rows, args.repeats)
        print(f"\n{shape_name} {shape}: fp32 GEMV streams {bound:.1f} GB/s (the bound); "
              f"fp32 at {args.rows} rows: {fp32:.0f} rows/s")
        for name in args.types.split(","):
            print(_type_row(name, shape, bound, args.rows, args.repeats, rng, args.layout), flush=True)
    with open("/proc/loadavg", encoding="utf-8") as load:
        print(f"\nloadavg after {load.read().split()[:3]}")


if __name__ == "__main__":
    main()
