"""ferrollm beside vLLM (CPU), HF transformers and llama.cpp: same checkpoint, same requests, one run.

Workloads (token ids drawn once from ``--seed`` with ferrollm's own generator, so every engine
gets the very same requests, lengths included):

- ``mixed``: 64 prompts, input 32-512 and output 16-256 tokens drawn per request;
- ``fixed``: 32 prompts x 128 in -> 128 out;
- ``latency``: batch 1, 32 in -> 128 out, 3 timed runs after 1 warm-up (decode tok/s);
- ``nanovllm``: nano-vllm's published shape, 256 prompts with input and output lengths drawn
  from 100-1023 (needs ``--max-model-len 2048`` or more; nano-vllm ran 4096);
- ``startup``: engine constructor to the first token of a one-token request, with the
  checkpoint's files read once just before, so each engine finds them in the page cache;
- ``serve`` (alone, never by default): ``ferrollm serve`` against ``vllm serve`` at the same
  request rate, each driven by ``ferrollm bench serve`` (benches/serve_bench.py).

``--rounds N`` runs the engines N times, alternating (ferrollm, vLLM, ferrollm, vLLM, ...), and
reports, per engine and workload, the round whose main figure is the median (the lower middle one
for an even N), with every round's figure beside it. On a VM whose speed drifts by 10-20% over
minutes, one round per engine leaves each ratio to whichever minutes each engine ran in.

``--dtype`` picks the dtype every engine runs in (default float32). For bfloat16, ferrollm, HF
and vLLM load the checkpoint in bf16, and llama.cpp reads a BF16 GGUF that llama.cpp's own
quantizer makes once from the f32 one (benches/peers/gguf_quantize.py, cached in the bench folder);
with ``--model smollm2`` llama.cpp keeps the stored Q4_1 GGUF, which bf16 would only inflate.

Throughput counts only the tokens each request asked for. Beside each figure: the machine's
roofline (benches/roofline.py) and the fraction of it reached; the last columns are ferrollm's
figure divided by each peer's. Under each workload, the peak RSS (``peak_rss_mib``) of the engine's
process that ran it, measured in that process: start-up included, each workload counted as if it
ran alone (see benches/peers/common.py).

``--device cuda`` runs ferrollm and HF on the GPU (ferrollm through the peers' runner,
``--ferrollm-driver peer``, so one process runs every workload; HF moves its model and inputs to
the GPU) and measures the GPU's roofline (benches/roofline.py ``measure_gpu``) instead of the CPU's.

ferrollm's figures also carry the weight bytes its start-up log reports (``weights_mib``, and
``quantized_linear_mib`` for quantized layers); llama.cpp's, the bytes of its model's tensors.

``--quant`` runs the quantized side-by-side instead (benches/quant_bench.py): the SmolLM2 Q4_1
GGUF, the Qwen2-0.5B-shaped checkpoint as Q8_0/Q4_0 GGUF (ferrollm beside llama.cpp on the same
file) and as compressed-tensors W8A8/W4A16 beside the same model in fp32 and bf16 (ferrollm).

Run from the repository root with the project's interpreter, after ``bash benches/peers/setup.sh``:

    .venv/bin/python benches/side_by_side.py [--model qwen2|smollm2] \
        [--engines ferrollm,hf,vllm,llamacpp] [--workloads startup,mixed,fixed,latency] \
        [--dtype float32|bfloat16] [--device cuda]
    .venv/bin/python benches/side_by_side.py --quant all [--workloads latency,mixed] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import roofline  # noqa: E402  (benches/ is on the path from here on)

ENGINES = ("ferrollm", "hf", "vllm", "llamacpp")
WORKLOADS = ("startup", "mixed", "fixed", "latency", "nanovllm")


@dataclass(frozen=True)
class Workload:
    """A request set described the way ``ferrollm bench`` takes it."""

    kind: str  # throughput | latency
    num_prompts: int
    input_len: int
    output_len: int
    range_ratio: float = 0.0
    num_iters: int = 3
    num_iters_warmup: int = 1


# mixed: centre 272 +- 240 in, 136 +- 120 out; 240/272 == 120/136, so one ratio gives 32-512 / 16-256.
SPECS = {
    "mixed": Workload("throughput", 64, 272, 136, 240 / 272),
    "fixed": Workload("throughput", 32, 128, 128),
    "latency": Workload("latency", 1, 32, 128),
    # nano-vllm's bench.py: 256 sequences, input and output lengths uniform in 100-1024.
    "nanovllm": Workload("throughput", 256, 562, 562, 462 / 562 - 1e-9),
}
# --smoke: the same shapes, small enough to prove the harness end to end in a few minutes.
SMOKE_SPECS = {
    "mixed": Workload("throughput", 4, 48, 12, 1 / 3),
    "fixed": Workload("throughput", 4, 16, 16),
    "latency": Workload("latency", 1, 8, 16, num_iters=1),
    "nanovllm": Workload("throughput", 8, 48, 12, 1 / 3),
}
STARTUP = Workload("latency", 1, 1, 1, num_iters=1, num_iters_warmup=0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--workloads", default=None, help=f"default: {','.join(WORKLOADS)} (with --quant: latency,mixed)")
    p.add_argument("--quant", default=None,
                   help="the quantized side-by-side instead: 'all' or some of "
                        "smollm2-q4_1,gguf-q8_0,gguf-q4_0,ct-w8a8,ct-w4a16,fp32,bf16 (benches/quant_bench.py)")
    p.add_argument("--model", choices=("qwen2", "smollm2"), default="qwen2")
    p.add_argument("--dtype", choices=tuple(roofline.DTYPES), default="float32", help="the dtype every engine runs in")
    p.add_argument("--bench-dir", type=Path, default=REPO / ".bench")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--num-iters", type=int, default=3, help="timed runs of the latency workload")
    p.add_argument("--rounds", type=int, default=1,
                   help="runs of every engine, alternating; each figure is the median round's")
    p.add_argument("--hf-batch-size", type=int, default=32)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                   help="where ferrollm and HF run (vLLM and llama.cpp are CPU builds)")
    p.add_argument("--ferrollm-driver", choices=("cli", "peer"), default=None,
                   help="`ferrollm bench` per workload (cli, the CPU default) or one process through "
                        "benches/peers/ferrollm_bench.py (peer, the GPU default)")
    p.add_argument("--enforce-eager", action="store_true", help="ferrollm without CUDA graphs")
    p.add_argument("--compilation-config", default=None, help="ferrollm's level (0-3) on a GPU")
    p.add_argument("--vllm-enforce-eager", action="store_true")
    p.add_argument("--ferrollm", default=str(Path(sys.executable).parent / "ferrollm"),
                   help="ferrollm CLI (default: the one beside this interpreter)")
    p.add_argument("--hf-python", default=sys.executable, help="interpreter for HF (default: this one)")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="set in every engine's environment, and kept in the report (repeatable)")
    p.add_argument("--skip-roofline", action="store_true")
    p.add_argument("--smoke", action="store_true", help="tiny workloads: checks the harness, measures nothing")
    p.add_argument("--out", type=Path, default=None, help="JSON of every figure (default under <bench-dir>/results)")
    return p.parse_args()


def model_paths(args) -> dict:
    """What each engine loads for --model and --dtype, and the vocabulary the requests draw from.

    For qwen2 in bfloat16 llama.cpp's GGUF is the BF16 conversion, which ``bf16_gguf`` makes when
    it is not there yet; the other engines load the fp32 folder in the run dtype.
    """
    if args.model == "qwen2":
        folder = args.bench_dir / "qwen2-0.5b"
        gguf = args.bench_dir / ("qwen2-0.5b-bf16.gguf" if args.dtype == "bfloat16" else "qwen2-0.5b-f32.gguf")
        return {"ferrollm": folder, "hf": folder, "vllm": folder, "llamacpp": gguf,
                "sizing": folder, "vocab_size": 151936}
    from ferrollm.cli import default_model

    gguf = Path(default_model())
    # vLLM reads GGUF only through a plugin its CPU wheel does not carry. llama.cpp runs the Q4_1
    # file as stored in either dtype: a BF16 copy of 4-bit weights would only be bigger.
    return {"ferrollm": gguf, "hf": gguf, "vllm": None, "llamacpp": gguf, "sizing": gguf, "vocab_size": 49152}


def bf16_gguf(args, dst: Path) -> None:
    """Makes llama.cpp's BF16 GGUF from the f32 one once, with llama.cpp's quantizer."""
    if dst.exists():
        return
    src = args.bench_dir / "qwen2-0.5b-f32.gguf"
    print(f"llama.cpp: converting {src.name} -> {dst.name} ...", file=sys.stderr, flush=True)
    cmd = [str(args.bench_dir / "venv-llamacpp" / "bin" / "python"),
           str(Path(__file__).resolve().parent / "peers" / "gguf_quantize.py"), str(src), str(dst), "--ftype", "bf16",
           "--threads", str(args.threads)]
    _run(cmd, _log_path(args, "llamacpp"))


def write_requests(args, workloads: list[str], vocab_size: int) -> Path:
    from ferrollm.benchmarks.workloads import random_requests

    folder = args.bench_dir / "requests" / f"{args.model}-seed{args.seed}{'-smoke' if args.smoke else ''}"
    folder.mkdir(parents=True, exist_ok=True)
    for name in workloads:
        if name == "startup":
            continue
        w = args.specs[name]
        iters = args.num_iters if w.kind == "latency" else w.num_iters
        reqs = random_requests(w.num_prompts, w.input_len, w.output_len, vocab_size, w.range_ratio, args.seed)
        data = {"kind": w.kind, "num_iters": iters, "num_iters_warmup": w.num_iters_warmup,
                "requests": [{"prompt_token_ids": r.prompt_token_ids, "output_len": r.output_len} for r in reqs]}
        (folder / f"{name}.json").write_text(json.dumps(data))
    return folder


def warm_page_cache(model: Path) -> None:
    """Reads the checkpoint's files once, so every engine's start-up finds them in the page cache:
    the first engine of a run otherwise pays for the disk (21.7 s against 3.9-6.6 s for
    ferrollm's later start-ups in one run), and the later ones for whatever evicted them."""
    files = [p for p in model.rglob("*") if p.is_file()] if model.is_dir() else [model]
    for path in files:
        with open(path, "rb") as f:
            while f.read(16 << 20):
                pass


def _log_path(args, engine: str) -> Path:
    folder = args.bench_dir / "logs"
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"{getattr(args, 'log_prefix', 'side_by_side')}-{args.model}-{engine}.log"


def _run(cmd: list[str], log: Path, env: dict | None = None) -> str:
    """Runs one engine process; its stderr goes to the log, its stdout is returned."""
    print(f"  $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    with open(log, "a") as err:
        err.write(f"\n$ {' '.join(cmd)}\n")
        err.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {' '.join(cmd[:3])} ... (log: {log})")
    return proc.stdout


def run_ferrollm(args, model: Path, workloads: list[str], requests_dir: Path) -> dict:
    cli = args.ferrollm
    log = _log_path(args, "ferrollm")
    env = {"OMP_NUM_THREADS": str(args.threads)}
    out = args.bench_dir / "results" / "ferrollm-tmp.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    result: dict = {"engine": "ferrollm", "dtype": args.dtype}
    for name in workloads:
        w = STARTUP if name == "startup" else args.specs[name]
        cmd = [cli, "bench", w.kind, "--model", str(model), "--input-len", str(w.input_len),
               "--output-len", str(w.output_len), "--max-model-len", str(args.max_model_len),
               "--seed", str(args.seed), "--dtype", args.dtype, "--output-json", str(out)]
        if w.kind == "throughput":
            cmd += ["--num-prompts", str(w.num_prompts), "--random-range-ratio", repr(w.range_ratio)]
        else:
            iters = w.num_iters if name == "startup" else args.num_iters
            cmd += ["--batch-size", str(w.num_prompts), "--num-iters", str(iters),
                    "--num-iters-warmup", str(w.num_iters_warmup)]
        start = log.stat().st_size if log.exists() else 0
        sys.stdout.write(_run(cmd, log, env))
        figures = {**json.loads(out.read_text()), **logged_weight_bytes(log, start)}
        if name == "startup":
            figures = {"startup_time": figures["startup_time"] + figures["latencies"][0],
                       "constructor_time": figures["startup_time"], "peak_rss_mib": figures["peak_rss_mib"],
                       **logged_weight_bytes(log, start)}
        elif w.kind == "throughput":
            _check_same_requests(name, figures, requests_dir)
            figures["num_output_tokens"] = figures["total_num_tokens"] - _prompt_tokens(requests_dir, name)
        result[name] = figures
    return result


# What ferrollm's start-up log says its weights hold (engine/startup_report.py, quantization/__init__.py).
_WEIGHTS_LOG = re.compile(r"memory: weights ([\d.]+) MiB \(([\d.]+) MiB of them mapped")
_QUANTIZED_LOG = re.compile(r"quantized linear weights: ([\d.]+) MiB, from ([\d.]+) MiB")


def logged_weight_bytes(log: Path, start: int) -> dict:
    """The weight figures of the last start-up logged past byte ``start`` of ``log``, in MiB:
    ``weights_mib`` (every weight the engine holds), ``weights_mapped_mib`` (of them, pages of the
    checkpoint file), ``quantized_linear_mib`` and ``unquantized_linear_mib`` (the quantized
    layers, and what their weights would take in the run dtype), where logged."""
    with open(log, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    found: dict = {}
    if m := list(_WEIGHTS_LOG.finditer(text)):
        found.update(weights_mib=float(m[-1][1]), weights_mapped_mib=float(m[-1][2]))
    if m := list(_QUANTIZED_LOG.finditer(text)):
        found.update(quantized_linear_mib=float(m[-1][1]), unquantized_linear_mib=float(m[-1][2]))
    return found


def _prompt_tokens(requests_dir: Path, name: str) -> int:
    data = json.loads((requests_dir / f"{name}.json").read_text())
    return sum(len(r["prompt_token_ids"]) for r in data["requests"])


def _check_same_requests(name: str, figures: dict, requests_dir: Path) -> None:
    data = json.loads((requests_dir / f"{name}.json").read_text())
    total = sum(len(r["prompt_token_ids"]) + r["output_len"] for r in data["requests"])
    if figures["total_num_tokens"] != total:
        raise RuntimeError(f"{name}: ferrollm ran {figures['total_num_tokens']} tokens, the peers' requests "
                           f"have {total}: its workload generator no longer matches side_by_side's")


def run_peer(args, engine: str, model: Path, workloads: list[str], requests_dir: Path,
             extra: tuple[str, ...] = ()) -> dict:
    """Runs ``engine``'s driver in benches/peers/ (ferrollm's too, for figures every engine must get
    from the same runner) and returns its JSON; ``extra`` goes on its command line."""
    peers = Path(__file__).resolve().parent / "peers"
    common = ["--model", str(model), "--requests-dir", str(requests_dir), "--workloads", ",".join(workloads),
              "--threads", str(args.threads), "--max-model-len", str(args.max_model_len), "--seed", str(args.seed)]
    env: dict = {}
    if engine == "ferrollm":
        cmd = [sys.executable, str(peers / "ferrollm_bench.py"), *common, "--device", args.device]
        cmd += ["--dtype", args.dtype] if args.device == "cuda" else []
        cmd += ["--enforce-eager"] if args.enforce_eager else []
        cmd += ["--compilation-config", args.compilation_config] if args.compilation_config else []
        env["OMP_NUM_THREADS"] = str(args.threads)
    elif engine == "hf":
        cmd = [args.hf_python, str(peers / "hf_bench.py"), *common, "--batch-size", str(args.hf_batch_size),
               "--dtype", args.dtype, "--device", args.device]
        env["OMP_NUM_THREADS"] = str(args.threads)
    elif engine == "vllm":
        cmd = [str(args.bench_dir / "venv-vllm" / "bin" / "python"), str(peers / "vllm_bench.py"), *common,
               "--dtype", args.dtype]
        cmd += ["--enforce-eager"] if args.vllm_enforce_eager else []
    else:
        cmd = [str(args.bench_dir / "venv-llamacpp" / "bin" / "python"), str(peers / "llamacpp_bench.py"), *common]
    lines = [line for line in _run([*cmd, *extra], _log_path(args, engine), env).splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def measure_roofline(args, sizing: Path, llamacpp_gguf: Path | None) -> dict:
    """The machine's ceilings and the bounds they put on the model: "fp32" and "bf16" for engines
    that load it in that dtype, "stored" for the sizing file's bytes as stored, and "llamacpp" for
    the GGUF llama.cpp reads (bf16 peak for a BF16 GGUF, the fp32 one otherwise, as before)."""
    machine = roofline.measure_gpu() if args.device == "cuda" else roofline.measure(args.threads)
    size = roofline.model_size(sizing)
    params = size["params"]
    roof = {**machine, "model": size,
            **{keys.bounds: roofline.bounds(machine, params, dtype=d) for d, keys in roofline.DTYPES.items()},
            "stored": roofline.bounds(machine, params, size["weight_bytes_stored"])}
    if llamacpp_gguf is not None and llamacpp_gguf.exists():
        gguf = llamacpp_gguf if llamacpp_gguf != sizing else None
        stored = roofline.model_size(gguf)["weight_bytes_stored"] if gguf else size["weight_bytes_stored"]
        dtype = "bfloat16" if llamacpp_gguf.name.endswith("-bf16.gguf") else "float32"
        roof["llamacpp"] = {"gguf": llamacpp_gguf.name, "weight_bytes": stored,
                            **roofline.bounds(machine, params, stored, dtype=dtype)}
    return roof


def run_engine(args, engine: str, model: Path | None, workloads: list[str], requests_dir: Path) -> dict:
    """One engine's figures for every workload, or ``{"error": ...}``."""
    if model is None:
        return {"error": f"{engine} cannot load the {args.model} checkpoint"}
    print(f"{engine} ...", file=sys.stderr, flush=True)
    if "startup" in workloads:
        warm_page_cache(model)
    start = time.perf_counter()
    try:
        if engine == "ferrollm" and args.ferrollm_driver == "cli":
            figures = run_ferrollm(args, model, workloads, requests_dir)
        else:
            figures = run_peer(args, engine, model, workloads, requests_dir)
    except (RuntimeError, OSError, ValueError) as e:
        figures = {"error": str(e)}
    figures["wall_time"] = time.perf_counter() - start
    return figures


# The figure that picks the median round of each workload.
MAIN_FIGURE = {"startup": "startup_time", "mixed": "tokens_per_second", "fixed": "tokens_per_second",
               "latency": "decode_tokens_per_second", "nanovllm": "tokens_per_second"}


def median_round(runs: list[dict], workloads: list[str]) -> dict:
    """Per workload, the figures of the round whose main figure is the median (the lower middle
    one for an even count), plus ``rounds``: that figure in every round, in run order. A round
    that failed is left out; an engine that failed every round keeps the first error."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    merged: dict = {"wall_time": sum(r["wall_time"] for r in runs), "rounds": len(runs)}
    for name in workloads:
        key = MAIN_FIGURE[name]
        ranked = sorted((r for r in good if name in r), key=lambda r: r[name][key])
        if ranked:
            merged[name] = {**ranked[(len(ranked) - 1) // 2][name], "rounds": [r[name][key] for r in good if name in r]}
    return merged


def main() -> None:
    args = parse_args()
    args.specs = SMOKE_SPECS if args.smoke else SPECS
    if args.ferrollm_driver is None:
        args.ferrollm_driver = "peer" if args.device == "cuda" else "cli"
    if args.smoke:
        args.num_iters = 1
    args.env = dict(kv.split("=", 1) for kv in args.env)
    os.environ.update(args.env)  # the engines' processes inherit it
    if args.quant:
        from quant_bench import main_quant

        return main_quant(args)
    args.workloads = args.workloads or ",".join(WORKLOADS)
    engines = [e for e in args.engines.split(",") if e]
    workloads = [w for w in args.workloads.split(",") if w]
    if workloads == ["serve"]:
        from serve_bench import main_serve

        return main_serve(args, engines, model_paths(args))
    for name in engines + workloads:
        if name not in ENGINES + WORKLOADS:
            sys.exit(f"unknown engine or workload: {name} (engines: {', '.join(ENGINES)}; "
                     f"workloads: {', '.join(WORKLOADS)}, or serve alone)")
    paths = model_paths(args)
    requests_dir = write_requests(args, workloads, paths["vocab_size"])
    report: dict = {"model": args.model, "dtype": args.dtype, "seed": args.seed, "threads": args.threads,
                    "device": args.device, "env": args.env, "engines": {}}
    if "llamacpp" in engines:
        gguf = paths["llamacpp"]
        report["llamacpp_gguf"] = gguf.name  # the dtype of llama.cpp's weights is the GGUF's
        if args.dtype == "bfloat16" and args.model == "qwen2":
            try:
                bf16_gguf(args, gguf)
            except (RuntimeError, OSError) as e:
                report["engines"]["llamacpp"] = {"error": f"BF16 GGUF conversion: {e}"}
        elif args.dtype != "float32":
            report["notes"] = [f"llama.cpp runs {gguf.name} as stored (quantized), not in {args.dtype}"]
    if not args.skip_roofline:
        print("roofline ...", file=sys.stderr, flush=True)
        gguf = paths["llamacpp"] if "llamacpp" in engines else None
        report["roofline"] = measure_roofline(args, paths["sizing"], gguf)
    rounds: dict[str, list[dict]] = {e: [] for e in engines if e not in report["engines"]}
    for i in range(args.rounds):
        for engine in rounds:
            if args.rounds > 1:
                print(f"round {i + 1} of {args.rounds}:", end=" ", file=sys.stderr, flush=True)
            rounds[engine].append(run_engine(args, engine, paths[engine], workloads, requests_dir))
    for engine, runs in rounds.items():
        report["engines"][engine] = runs[0] if len(runs) == 1 else median_round(runs, workloads)
    suffix = "" if args.dtype == "float32" else f"-{args.dtype}"  # float32 files keep their old names
    suffix += "-cuda" if args.device == "cuda" else ""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = args.out or args.bench_dir / "results" / f"side_by_side-{args.model}{suffix}-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    from report_table import format_report

    print(format_report(report, engines, workloads))
    print(f"\nfigures: {out}")


if __name__ == "__main__":
    main()
