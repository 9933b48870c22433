"""What every peer runner shares: the command line, the request files side_by_side.py writes, the
timing of each workload, the peak resident memory beside it and the one JSON line a runner
prints. Standard library only, so it imports in any peer's virtual environment.

A runner supplies an engine: ``make()`` builds it (the constructor whose time start-up counts) and
``generate(requests)`` runs a list of requests to completion, ignoring EOS, and returns how many
tokens each produced. An engine with a ``weight_bytes`` attribute (the bytes its weights hold)
has it in the JSON line.

Peak RSS (``peak_rss_mib``) is the kernel's high-water mark of resident memory (``VmHWM``, what
``ru_maxrss`` reports) of this process plus its live child processes (vLLM's engine core runs in
one), in MiB. Each workload's figure is the peak of the engine's start-up or of that workload,
whichever is higher: the mark is reset before each workload (``/proc/self/clear_refs``), so a
workload is not charged for an earlier, bigger one, and the figure is close to the one a process
that started the engine and ran this workload alone would show (``ferrollm bench`` runs each
workload in its own process); memory an allocator kept after an earlier workload still counts.
The top-level ``peak_rss_mib`` is the process's peak over the whole run.

Request file (``<requests-dir>/<workload>.json``)::

    {"kind": "throughput" | "latency", "num_iters": 3, "num_iters_warmup": 1,
     "requests": [{"prompt_token_ids": [...], "output_len": 128}, ...]}
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol


@dataclass(frozen=True)
class Request:
    prompt_token_ids: list[int]
    output_len: int


class Engine(Protocol):
    def generate(self, requests: list[Request]) -> list[int]: ...


def generate_offline(llm, sampling_params_cls, requests: list[Request], temperature: float) -> list[int]:
    """Runs ``requests`` through a vLLM-style ``LLM.generate`` (vLLM's or ferrollm's, which take the
    same arguments): token-id prompts, EOS ignored; returns each request's output length."""
    prompts = [{"prompt_token_ids": r.prompt_token_ids} for r in requests]
    params = [sampling_params_cls(temperature=temperature, top_p=1.0, ignore_eos=True, max_tokens=r.output_len)
              for r in requests]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [len(o.outputs[0].token_ids) for o in outs]


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", required=True, help="checkpoint folder (or GGUF file for llama.cpp)")
    p.add_argument("--requests-dir", type=Path, required=True)
    p.add_argument("--workloads", default="startup,mixed,fixed,latency",
                   help="comma-separated; 'startup' is always measured first")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=1.0,
                   help="0 for greedy decoding (llama.cpp's runner always takes the argmax)")
    return p


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, found through each process's parent in ``/proc``
    (``/proc/<pid>/task/*/children`` is not in every kernel)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state, ppid
        except (OSError, IndexError):  # a process that has just exited
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _hwm_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def peak_rss_mib() -> float:
    """This process's peak resident memory plus that of its live child processes, in MiB."""
    own = _hwm_kib(os.getpid())
    if own is None:  # no /proc: ru_maxrss is KiB on Linux (bytes on macOS, which has no /proc)
        scale = 1 if sys.platform.startswith("linux") else 1 / 1024
        own = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale)
    return (own + sum(_hwm_kib(pid) or 0 for pid in _descendants(os.getpid()))) / 1024


def reset_peak_rss() -> bool:
    """Lowers the peak-RSS mark of this process and its children to their present RSS (Linux 4.0+);
    False where the kernel does not allow it, and the marks then keep the earlier peaks."""
    try:
        for pid in [os.getpid(), *_descendants(os.getpid())]:
            Path(f"/proc/{pid}/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def load_workload(requests_dir: Path, name: str) -> dict:
    data = json.loads((requests_dir / f"{name}.json").read_text())
    data["requests"] = [Request(r["prompt_token_ids"], r["output_len"]) for r in data["requests"]]
    return data


def _check_counts(name: str, requests: list[Request], produced: list[int]) -> None:
    asked = [r.output_len for r in requests]
    if produced != asked:
        bad = sum(a != b for a, b in zip(asked, produced))
        raise RuntimeError(f"{name}: {bad} of {len(asked)} requests did not produce the tokens asked for")


def run_throughput(engine: Engine, name: str, requests: list[Request]) -> dict:
    start = time.perf_counter()
    produced = engine.generate(requests)
    elapsed = time.perf_counter() - start
    _check_counts(name, requests, produced)
    num_in = sum(len(r.prompt_token_ids) for r in requests)
    num_out = sum(r.output_len for r in requests)  # only what each request asked for
    return {
        "elapsed_time": elapsed, "num_requests": len(requests), "num_prompt_tokens": num_in,
        "num_output_tokens": num_out, "total_num_tokens": num_in + num_out,
        "requests_per_second": len(requests) / elapsed, "tokens_per_second": (num_in + num_out) / elapsed,
        "output_tokens_per_second": num_out / elapsed,
    }


def run_latency(engine: Engine, name: str, requests: list[Request], num_iters: int, num_iters_warmup: int) -> dict:
    def once() -> float:
        start = time.perf_counter()
        produced = engine.generate(requests)
        elapsed = time.perf_counter() - start
        _check_counts(name, requests, produced)
        return elapsed

    for _ in range(num_iters_warmup):
        once()
    latencies = [once() for _ in range(num_iters)]
    avg = sum(latencies) / len(latencies)
    num_out = sum(r.output_len for r in requests)
    return {"avg_latency": avg, "latencies": latencies, "batch_size": len(requests),
            "decode_tokens_per_second": num_out / avg}


def run(engine_name: str, make: Callable[[], Engine], args: argparse.Namespace, extra: dict | None = None) -> None:
    """Builds the engine, measures start-up (constructor to the first token of a one-token request),
    runs the selected workloads on the same engine and prints one JSON line."""
    names = [w for w in args.workloads.split(",") if w and w != "startup"]
    start = time.perf_counter()
    engine = make()
    constructed = time.perf_counter()
    produced = engine.generate([Request([100], 1)])
    first_token = time.perf_counter()
    _check_counts("startup", [Request([100], 1)], produced)
    startup_peak = peak_rss_mib()
    result: dict = {"engine": engine_name, **(extra or {}),
                    "startup": {"startup_time": first_token - start, "constructor_time": constructed - start,
                                "peak_rss_mib": startup_peak}}
    if getattr(engine, "weight_bytes", None) is not None:
        result["weight_bytes"] = engine.weight_bytes
    process_peak = startup_peak
    for name in names:
        w = load_workload(args.requests_dir, name)
        print(f"[{engine_name}] {name}: {len(w['requests'])} requests", file=sys.stderr, flush=True)
        reset = reset_peak_rss()
        if w["kind"] == "latency":
            result[name] = run_latency(engine, name, w["requests"], w.get("num_iters", 3), w.get("num_iters_warmup", 1))
        else:
            result[name] = run_throughput(engine, name, w["requests"])
        peak = peak_rss_mib()
        process_peak = max(process_peak, peak)
        result[name]["peak_rss_mib"] = max(startup_peak, peak)
        if not reset:
            result[name]["peak_rss_includes_earlier_workloads"] = True
    result["peak_rss_mib"] = process_peak
    print(json.dumps(result), flush=True)
