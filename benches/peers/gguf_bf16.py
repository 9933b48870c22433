"""Converts a GGUF to BF16 with llama.cpp's own quantizer, so llama.cpp can join a bf16 side-by-side.

Runs ``llama_model_quantize`` through llama-cpp-python's low-level bindings with ftype
``LLAMA_FTYPE_MOSTLY_BF16`` (llama.cpp keeps its usual exceptions, such as 1-D norm weights, in
f32). The result is written next to its final name and renamed into place, so an interrupted run
leaves no half-written file behind; an existing output is kept (side_by_side.py caches it).

    .bench/venv-llamacpp/bin/python benches/peers/gguf_bf16.py \
        .bench/qwen2-0.5b-f32.gguf .bench/qwen2-0.5b-bf16.gguf [--threads 2]
"""

from __future__ import annotations

import argparse
import ctypes
import sys
import time
from pathlib import Path


def convert_bf16(src: Path, dst: Path, threads: int = 2) -> None:
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = L.LLAMA_FTYPE_MOSTLY_BF16
    params.nthread = threads
    tmp = dst.with_name(dst.name + ".tmp")
    L.llama_backend_init()
    if L.llama_model_quantize(str(src).encode(), str(tmp).encode(), ctypes.byref(params)) != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize failed: {src} -> {tmp}")
    tmp.replace(dst)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", type=Path, help="GGUF to convert (f32 or f16)")
    p.add_argument("dst", type=Path, help="BF16 GGUF to write")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.dst.exists():
        print(f"{args.dst} already there", file=sys.stderr)
        return
    start = time.perf_counter()
    convert_bf16(args.src, args.dst, args.threads)
    print(f"{args.src} -> {args.dst} (bf16) in {time.perf_counter() - start:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
