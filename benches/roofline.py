"""Measures this machine's ceilings for the side-by-side benchmark and the bounds they put on a model.

- memory bandwidth: summing (read) and copying (read + write) a 512 MiB fp32 array;
- peak matmul FLOP/s in fp32 and in bf16: the best of ``torch.mm`` at large M (a square problem
  and the model's MLP shape) and oneDNN on a prepacked weight at 512 rows (the MLP's gate/up
  shape), the same shapes for both dtypes. On the 2-core Zen 4 development machine ``torch.mm``
  tops out at ~172 GFLOP/s in fp32 where packed oneDNN reaches ~219 and a register-only FMA loop
  ~220: taking ``torch.mm`` alone put engines above "100%" of the bound.

Batch-1 decode reads every weight once per token, so its bound is ``read bandwidth / (params x
bytes per element)`` of the dtype the engine runs in; batched work is compute-bound at that dtype's
``peak FLOP/s / (2 x params)`` tokens/s.

On a GPU (``--device cuda``) the same keys come from the device: read bandwidth from a sum over
a 2 GiB bf16 buffer, copy bandwidth from a device-to-device copy (bytes read plus written), and
the matmul peaks from 8192^3 ``torch.mm`` (fp32 without TF32, and bf16), each the best of 10
event-timed runs after a warm-up, on random data; ``device`` names the GPU.

    python benches/roofline.py [--threads 2] [--model .bench/qwen2-0.5b] [--device cuda]   # one JSON line
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import NamedTuple

GIB = 1 << 30


def _best_time(fn, repeats: int) -> float:
    fn()  # warm-up: page faults, thread pool
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(size_bytes: int = 512 << 20, repeats: int = 5) -> dict:
    import torch

    src = torch.ones(size_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    read = size_bytes / _best_time(lambda: src.sum(), repeats)
    copy = 2 * size_bytes / _best_time(lambda: dst.copy_(src), repeats)
    return {"read_bytes_per_s": read, "copy_bytes_per_s": copy}


class DtypeKeys(NamedTuple):
    """Where a run dtype's figures sit in a roofline: its matmul peak in ``measure()``'s result, its
    bounds (also its short name) in side_by_side's report, and its bytes per element."""

    peak: str
    bounds: str
    elem_bytes: int


# The dtypes a side-by-side can run in. torch is imported inside the measuring functions, so
# report_table.py can read this table without it.
DTYPES = {"float32": DtypeKeys("matmul_flops", "fp32", 4), "bfloat16": DtypeKeys("matmul_flops_bf16", "bf16", 2)}


def matmul_flops(dtype: str = "float32", repeats: int = 3) -> dict:
    import torch

    shapes = {"square_2048": (2048, 2048, 2048), "square_4096": (4096, 4096, 4096),
              "mlp_4096x896x4864": (4096, 896, 4864)}
    out = {}
    for name, (m, k, n) in shapes.items():
        a, b = torch.randn(m, k, dtype=getattr(torch, dtype)), torch.randn(k, n, dtype=getattr(torch, dtype))
        out[name] = 2 * m * k * n / _best_time(lambda: torch.mm(a, b), repeats)
    out["onednn_packed_512x896x9728"] = _packed_flops(getattr(torch, dtype), 512, 896, 9728, repeats)
    out["peak"] = max(out.values())
    return out


def _packed_flops(dtype, m: int, k: int, n: int, repeats: int) -> float:
    """FLOP/s of oneDNN's GEMM on a weight packed once (torch's ``mkldnn`` ops), or 0 without."""
    import torch

    if not torch.backends.mkldnn.is_available():
        return 0.0
    x, weight = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight)
        run = lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")  # noqa: E731
        run()
    except RuntimeError:  # a dtype this oneDNN build cannot pack
        return 0.0
    return 2 * m * k * n / _best_time(run, repeats)


def model_size(model: Path) -> dict:
    """Parameter count, fp32 bytes and stored bytes read per decode step (tied embeddings once).

    ``model`` is a safetensors checkpoint folder or a GGUF file (whose stored bytes may be
    quantized: that is what llama.cpp reads per step, while engines that dequantize read fp32).
    """
    params = stored = 0
    if model.suffix == ".gguf":
        from gguf import GGUFReader

        for t in GGUFReader(str(model)).tensors:
            params += int(t.n_elements)
            stored += int(t.n_bytes)
    else:
        from safetensors import safe_open

        for f in sorted(model.glob("*.safetensors")):
            with safe_open(str(f), "pt") as st:
                for key in st.keys():
                    sl = st.get_slice(key)
                    count = 1
                    for d in sl.get_shape():
                        count *= d
                    params += count
                    stored += count * _ST_BYTES[sl.get_dtype()]
    return {"params": params, "weight_bytes_fp32": 4 * params, "weight_bytes_bf16": 2 * params,
            "weight_bytes_stored": stored}


_ST_BYTES = {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def bounds(machine: dict, params: int, weight_bytes: int | None = None, dtype: str = "float32") -> dict:
    """Tokens/s bounds for an engine computing in ``dtype`` that reads ``weight_bytes`` per decode
    step (default: every parameter in ``dtype``)."""
    keys = DTYPES[dtype]
    if weight_bytes is None:
        weight_bytes = params * keys.elem_bytes
    return {
        "batch1_tokens_per_s": machine["bandwidth"]["read_bytes_per_s"] / weight_bytes,
        "batched_tokens_per_s": machine[keys.peak]["peak"] / (2 * params),
    }


def measure(threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    return {"threads": threads, "bandwidth": memory_bandwidth(),
            **{keys.peak: matmul_flops(dtype) for dtype, keys in DTYPES.items()}}


def _best_cuda_time(fn, repeats: int = 10) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def measure_gpu() -> dict:
    """The GPU's HBM bandwidth and matmul peaks, under the keys `measure` uses."""
    import torch

    size = 2 << 30
    src = torch.randn(size // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    read = size / _best_cuda_time(lambda: src.sum(dtype=torch.float32))
    copy = 2 * size / _best_cuda_time(lambda: dst.copy_(src))
    del src, dst
    peaks = {}
    for dtype, keys in DTYPES.items():
        a = torch.randn(8192, 8192, dtype=getattr(torch, dtype), device="cuda")
        b = torch.randn(8192, 8192, dtype=getattr(torch, dtype), device="cuda")
        flops = 2 * 8192**3 / _best_cuda_time(lambda: torch.mm(a, b))
        peaks[keys.peak] = {"square_8192": flops, "peak": flops}
        del a, b
    # Engines run in other processes beside this one: leave them the memory (the context stays).
    torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "threads": 0,
            "bandwidth": {"read_bytes_per_s": read, "copy_bytes_per_s": copy}, **peaks}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--model", type=Path, default=None, help="safetensors folder or GGUF file to size")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    args = p.parse_args()
    result = measure_gpu() if args.device == "cuda" else measure(args.threads)
    if args.model is not None:
        size = model_size(args.model)
        # fp32 bounds at the top level (as before), then every run dtype's under its key.
        result["model"] = {**size, **bounds(result, size["params"], dtype="float32"),
                           **{keys.bounds: bounds(result, size["params"], dtype=d) for d, keys in DTYPES.items()}}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
