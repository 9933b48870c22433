"""The figures of `ferrollm bench serve`, computed as vLLM's `calculate_metrics` defines them, printed
in vLLM's layout, and saved under vLLM's JSON keys (milliseconds for the latency statistics)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np

PERCENTILES = (99,)
METRICS = (("ttft", "Time to First Token", "TTFT"), ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
           ("itl", "Inter-token Latency", "ITL"), ("e2el", "End-to-end Latency", "E2EL"))


def _stats(key: str, values: list[float]) -> dict:
    ms = np.asarray(values or [0.0]) * 1000
    out = {f"mean_{key}_ms": float(ms.mean()), f"median_{key}_ms": float(np.median(ms)),
           f"std_{key}_ms": float(ms.std())}
    out.update({f"p{p}_{key}_ms": float(np.percentile(ms, p)) for p in PERCENTILES})
    return out


def compute_metrics(results, duration: float, tokenizer) -> dict:
    """Totals over the successful requests; each request's output tokens are the server's count,
    or the re-tokenized text's when the server sent no usage."""
    ok = [r for r in results if r.success]
    out_lens = [r.output_tokens if r.output_tokens is not None
                else len(tokenizer(r.generated_text, add_special_tokens=False).input_ids) for r in ok]
    tpots = [(r.latency - r.ttft) / (n - 1) for r, n in zip(ok, out_lens) if n > 1]
    total_in, total_out = sum(r.prompt_len for r in ok), sum(out_lens)
    result = {
        "duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration, "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [r.prompt_len for r in results], "output_lens": [n for n in out_lens],
        "ttfts": [r.ttft for r in results], "itls": [r.itl for r in results],
        "generated_texts": [r.generated_text for r in results], "errors": [r.error for r in results],
    }
    series = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [x for r in ok for x in r.itl],
              "e2el": [r.latency for r in ok]}
    for key, values in series.items():
        result.update(_stats(key, values))
    return result


def print_report(m: dict, args) -> None:
    """vLLM's `bench serve` report: 40-column labels, 50-column rules."""
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    print("{:<40} {:<10}".format("Successful requests:", m["completed"]))
    print("{:<40} {:<10}".format("Failed requests:", m["failed"]))
    if args.max_concurrency is not None:
        print("{:<40} {:<10}".format("Maximum request concurrency:", args.max_concurrency))
    if args.request_rate != float("inf"):
        print("{:<40} {:<10.2f}".format("Request rate configured (RPS):", args.request_rate))
    print("{:<40} {:<10.2f}".format("Benchmark duration (s):", m["duration"]))
    print("{:<40} {:<10}".format("Total input tokens:", m["total_input_tokens"]))
    print("{:<40} {:<10}".format("Total generated tokens:", m["total_output_tokens"]))
    print("{:<40} {:<10.2f}".format("Request throughput (req/s):", m["request_throughput"]))
    print("{:<40} {:<10.2f}".format("Output token throughput (tok/s):", m["output_throughput"]))
    print("{:<40} {:<10.2f}".format("Total Token throughput (tok/s):", m["total_token_throughput"]))
    for key, header, short in METRICS[:3]:
        print("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        print("{:<40} {:<10.2f}".format(f"Mean {short} (ms):", m[f"mean_{key}_ms"]))
        print("{:<40} {:<10.2f}".format(f"Median {short} (ms):", m[f"median_{key}_ms"]))
        for p in PERCENTILES:
            print("{:<40} {:<10.2f}".format(f"P{p} {short} (ms):", m[f"p{p}_{key}_ms"]))
    print("=" * 50)


def save_result(result: dict, args, model_id: str) -> Path:
    """Writes the result as JSON, named as vLLM names it unless `--result-filename` is given."""
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate}"
    conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
    name = args.result_filename or f"{args.backend}-{rate}qps{conc}-{model_id}-{datetime.now():%Y%m%d-%H%M%S}.json"
    path = Path(args.result_dir or ".") / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))
    return path
