"""The two benchmarks. Each prints the lines vLLM's `bench throughput` / `bench latency` print,
plus the engine's start-up time and the process's peak resident memory, and can write the
figures as JSON."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

import numpy as np

from ferrollm.benchmarks.workloads import BenchRequest, random_requests


# Engine options the benchmarks do not take: the peak RSS they report is this process's, and
# tensor or pipeline parallel ranks would run in others.
_NOT_BENCHED = frozenset({"tensor_parallel_size", "pipeline_parallel_size", "distributed_executor_backend"})
# Engine options the benchmarks define themselves, with their own defaults.
_BENCH_DEFAULTS = frozenset({"model", "enable_prefix_caching", "seed"})


def add_common_args(p: argparse.ArgumentParser) -> None:
    """The workload's flags, and every engine option ferrollm implements (`--quantization`,
    `--kv-cache-dtype`, `--hf-overrides`, ...) under vLLM's names, as `vllm bench` takes them."""
    from ferrollm.entrypoints.openai.cli_args import add_engine_args

    p.add_argument("--model", required=True)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-json", default=None)
    add_engine_args(p, skip=_NOT_BENCHED | _BENCH_DEFAULTS)


def peak_rss_mib() -> float:
    """The process's peak resident memory in MiB: the kernel's high-water mark (``VmHWM``, what
    ``ru_maxrss`` reports), start-up included. The engine runs in this process (the bench takes
    no tensor-parallel option), so nothing outside it is left out."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return maxrss / (1024 if sys.platform.startswith("linux") else 1024 * 1024)


def _make_llm(args):
    from ferrollm import LLM

    from ferrollm.entrypoints.openai.cli_args import given_engine_args

    start = time.perf_counter()
    own = {"model": args.model, "enable_prefix_caching": args.enable_prefix_caching, "seed": args.seed}
    llm = LLM(**{**given_engine_args(args), **own})
    return llm, time.perf_counter() - start


def _params(output_len: int):
    from ferrollm import SamplingParams

    return SamplingParams(temperature=1.0, top_p=1.0, ignore_eos=True, max_tokens=output_len)


def _prompts(reqs: list[BenchRequest]) -> list[dict]:
    return [{"prompt_token_ids": r.prompt_token_ids} for r in reqs]


def run_throughput(args) -> dict:
    llm, startup = _make_llm(args)
    reqs = random_requests(args.num_prompts, args.input_len, args.output_len, llm.llm_engine.vocab_size,
                           args.random_range_ratio, args.seed)
    params = [_params(r.output_len) for r in reqs]
    start = time.perf_counter()
    outs = llm.generate(_prompts(reqs), params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    num_in = sum(len(r.prompt_token_ids) for r in reqs)
    num_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    llm.close()
    result = {
        "elapsed_time": elapsed, "num_requests": len(reqs), "total_num_tokens": num_in + num_out,
        "requests_per_second": len(reqs) / elapsed, "tokens_per_second": (num_in + num_out) / elapsed,
        "output_tokens_per_second": num_out / elapsed, "startup_time": startup, "peak_rss_mib": peak_rss_mib(),
    }
    print(f"Throughput: {result['requests_per_second']:.2f} requests/s, "
          f"{result['tokens_per_second']:.2f} total tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {num_in}")
    print(f"Total num output tokens:  {num_out}")
    print(f"Start-up time: {startup:.2f} s")
    print(f"Peak RSS: {result['peak_rss_mib']:.0f} MiB")
    _write(args, result)
    return result


def run_latency(args) -> dict:
    llm, startup = _make_llm(args)
    reqs = random_requests(args.batch_size, args.input_len, args.output_len, llm.llm_engine.vocab_size, 0.0, args.seed)
    params = _params(args.output_len)

    def once() -> float:
        start = time.perf_counter()
        llm.generate(_prompts(reqs), params, use_tqdm=False)
        return time.perf_counter() - start

    for _ in range(args.num_iters_warmup):
        once()
    latencies = np.array([once() for _ in range(args.num_iters)])
    llm.close()
    pct = [10, 25, 50, 75, 90, 99]
    result = {"avg_latency": float(latencies.mean()), "latencies": latencies.tolist(), "startup_time": startup,
              "percentiles": {str(p): float(np.percentile(latencies, p)) for p in pct},
              "decode_tokens_per_second": args.batch_size * args.output_len / float(latencies.mean()),
              "peak_rss_mib": peak_rss_mib()}
    print(f"Avg latency: {result['avg_latency']} seconds")
    for p in pct:
        print(f"{p}% percentile latency: {result['percentiles'][str(p)]} seconds")
    print(f"Start-up time: {startup:.2f} s")
    print(f"Peak RSS: {result['peak_rss_mib']:.0f} MiB")
    _write(args, result)
    return result


def _write(args, result: dict) -> None:
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)


def add_bench_parser(sub) -> None:
    bench = sub.add_parser("bench", help="throughput and latency benchmarks (vLLM's flags)")
    kinds = bench.add_subparsers(dest="bench_kind", required=True)
    t = kinds.add_parser("throughput", help="offline throughput on random prompts")
    add_common_args(t)
    t.add_argument("--num-prompts", type=int, default=1000)
    t.set_defaults(func=run_throughput)
    lat = kinds.add_parser("latency", help="latency of one batch")
    add_common_args(lat)
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--num-iters-warmup", type=int, default=1)
    lat.add_argument("--num-iters", type=int, default=3)
    lat.set_defaults(func=run_latency)
    from ferrollm.benchmarks.serve import add_serve_bench_parser

    add_serve_bench_parser(kinds)
