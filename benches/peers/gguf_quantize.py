"""Converts a GGUF to another type with llama.cpp's own quantizer: BF16 for a bf16 side-by-side,
Q8_0 and Q4_0 for the quantized one.

Runs ``llama_model_quantize`` through llama-cpp-python's low-level bindings with the ftype
``LLAMA_FTYPE_MOSTLY_<FTYPE>`` (llama.cpp keeps its usual exceptions: 1-D norm weights and biases
in f32, and its own choice for the token embedding). The result is written next to its final
name and renamed into place, so an interrupted run leaves no half-written file behind; an existing
output is kept (side_by_side.py caches it). llama.cpp's per-tensor log goes to stderr.

    .bench/venv-llamacpp/bin/python benches/peers/gguf_quantize.py \
        .bench/qwen2-0.5b-f32.gguf .bench/qwen2-0.5b-q4_0.gguf --ftype q4_0 [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path

FTYPES = ("bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q6_k", "q4_k_m", "q5_k_m")


def quantize(src: Path, dst: Path, ftype: str, threads: int = 2) -> None:
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}")
    params.nthread = threads
    tmp = dst.with_name(dst.name + ".tmp")
    L.llama_backend_init()
    if L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize failed: {src} -> {tmp} ({ftype})")
    tmp.replace(dst)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="GGUF to convert (f32 or f16)")
    p.add_argument("dst", type=Path, help="GGUF to write")
    p.add_argument("--ftype", choices=FTYPES, default="bf16")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.dst.exists():
        print(f"{args.dst} already there", file=sys.stderr)
        return
    start = time.perf_counter()
    quantize(args.src, args.dst, args.ftype, args.threads)
    print(f"{args.src} -> {args.dst} ({args.ftype}) in {time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
