"""`ferrollm bench serve`: vLLM's online serving benchmark against a running OpenAI-compatible server
(ferrollm's or vLLM's), with vLLM's flags, printed report and JSON result.

Each request streams (`stream: true`, `stream_options.include_usage`) through the official `openai`
async client. Definitions follow vLLM's: TTFT is the time from sending to the first chunk with
choices; ITL is the gap between successive such chunks; TPOT is `(e2e - TTFT) / (output_tokens - 1)`
for requests with more than one output token; a request's output tokens are the server's
`usage.completion_tokens` (re-tokenized text when the server sends no usage). Requests are sent at
`--request-rate` (gamma-distributed gaps, Poisson when `--burstiness` is 1; all at once for `inf`),
at most `--max-concurrency` in flight.

Cost: one coroutine per request on one event loop; tokenizer work (random prompts) happens before
the clock starts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

from ferrollm.benchmarks.workloads import BenchRequest, random_requests

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


@dataclass
class RequestResult:
    """What one streamed request measured (seconds)."""

    prompt_len: int
    success: bool = False
    output_tokens: int | None = None
    generated_text: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    error: str = ""


def add_serve_bench_parser(kinds) -> None:
    """`ferrollm bench serve` with vLLM's flag names and defaults."""
    p = kinds.add_parser("serve", help="online serving benchmark against a running server")
    p.add_argument("--backend", default="openai", choices=["openai", "openai-chat", "vllm"])
    p.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (overrides --host/--port)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default=None, help=f"one of {ENDPOINTS}; defaults to the backend's")
    p.add_argument("--model", default=None, help="checkpoint or hub id: the name sent (unless --served-model-name) "
                   "and the tokenizer; default: the server's first model")
    p.add_argument("--served-model-name", default=None, help="name sent in requests when --model is a path")
    p.add_argument("--tokenizer", default=None, help="tokenizer for random prompts (default: --model)")
    p.add_argument("--dataset-name", default="random", choices=["random"])
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--disable-tqdm", action="store_true", help="accepted for vLLM compatibility (no bar is drawn)")
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default=None)
    p.add_argument("--result-filename", default=None)
    p.set_defaults(func=run_serve)


def _check_args(args) -> None:
    endpoint = args.endpoint or ("/v1/chat/completions" if args.backend == "openai-chat" else "/v1/completions")
    if endpoint not in ENDPOINTS:
        raise SystemExit(f"ferrollm bench serve: `--endpoint` must be one of {ENDPOINTS}. Given: {endpoint}")
    args.endpoint = endpoint
    if args.request_rate <= 0:
        raise SystemExit(f"ferrollm bench serve: `--request-rate` must be > 0. Given: {args.request_rate}")
    if args.burstiness <= 0:
        raise SystemExit(f"ferrollm bench serve: `--burstiness` must be > 0. Given: {args.burstiness}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit(f"ferrollm bench serve: `--max-concurrency` must be >= 1. Given: {args.max_concurrency}")


def _client(args):
    import openai

    root = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    # vLLM's benchmark sends OPENAI_API_KEY as the bearer token when it is set.
    return openai.AsyncOpenAI(base_url=root + "/v1", api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                              max_retries=0, timeout=6 * 60 * 60)


async def _send(client, args, model: str, req: BenchRequest, prompt_text: str) -> RequestResult:
    """One streamed request; never raises (a failure is recorded in the result)."""
    res = RequestResult(prompt_len=len(req.prompt_token_ids))
    common = {"model": model, "stream": True, "stream_options": {"include_usage": True},
              "temperature": args.temperature, "extra_body": {"ignore_eos": args.ignore_eos}}
    start = last = time.perf_counter()
    try:
        if args.endpoint == "/v1/chat/completions":
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt_text}], max_completion_tokens=req.output_len, **common)
        else:
            # Token ids, so the server sees exactly the drawn prompt length.
            stream = await client.completions.create(prompt=req.prompt_token_ids, max_tokens=req.output_len, **common)
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.choices:
                c = chunk.choices[0]
                text = c.delta.content if args.endpoint == "/v1/chat/completions" else c.text
                if not res.success:
                    res.success, res.ttft = True, now - start
                else:
                    res.itl.append(now - last)
                last = now
                res.generated_text += text or ""
            if chunk.usage is not None:
                res.output_tokens = chunk.usage.completion_tokens
                if args.endpoint == "/v1/chat/completions":
                    res.prompt_len = chunk.usage.prompt_tokens  # the chat template adds tokens
        res.latency = last - start
        if not res.success:
            res.error = "never received a chunk with choices"
    except Exception as e:  # noqa: BLE001  (recorded per request, as vLLM does)
        res.success, res.error = False, f"{type(e).__name__}: {e}"
    return res


async def _arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator):
    """Yields request indices at the configured rate (gamma gaps with mean 1/rate)."""
    for i in range(n):
        yield i
        if rate != float("inf") and i + 1 < n:
            await asyncio.sleep(rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness)))


async def _benchmark(args, model: str, reqs: list[BenchRequest], texts: list[str]):
    client = _client(args)
    # One short request first, as vLLM does: a server that cannot answer fails fast, before the clock.
    probe = BenchRequest(reqs[0].prompt_token_ids, min(reqs[0].output_len, 4))
    test = await _send(client, args, model, probe, texts[0])
    if not test.success:
        raise SystemExit(f"ferrollm bench serve: the initial test request failed: {test.error}")
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    async def limited(i: int) -> RequestResult:
        if sem is None:
            return await _send(client, args, model, reqs[i], texts[i])
        async with sem:
            return await _send(client, args, model, reqs[i], texts[i])

    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    arrivals = _arrivals(len(reqs), args.request_rate, args.burstiness, rng)
    tasks = [asyncio.create_task(limited(i)) async for i in arrivals]
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    await client.close()
    return list(results), duration


def _resolve_model(args) -> tuple[str, str]:
    """(name sent in requests, tokenizer source)."""
    name = args.served_model_name or args.model
    if name is None:
        async def first_model() -> str:
            client = _client(args)
            models = await client.models.list()
            await client.close()
            return models.data[0].id
        name = asyncio.run(first_model())
    return name, args.tokenizer or args.model or name


def _tokenizer(source: str):
    """transformers' tokenizer of a folder or hub id, or of a local `.gguf` file (as the engine
    builds it from the file's metadata)."""
    from pathlib import Path

    from transformers import AutoTokenizer

    if source.endswith(".gguf") and Path(source).is_file():
        from ferrollm.config.model_source import resolve_model_source
        from ferrollm.engine.tokenizer_loader import load_tokenizers

        return load_tokenizers(resolve_model_source(source), None).hf
    return AutoTokenizer.from_pretrained(source)


def run_serve(args) -> dict:
    """Runs the benchmark, prints vLLM's report and returns (and optionally saves) the result."""
    from ferrollm.benchmarks.serve_report import (
        compute_metrics,
        print_report,
        save_result,
    )

    _check_args(args)
    model, tok_source = _resolve_model(args)
    tokenizer = _tokenizer(tok_source)
    reqs = random_requests(args.num_prompts, args.random_input_len, args.random_output_len, len(tokenizer),
                           args.random_range_ratio, args.seed)
    texts = [tokenizer.decode(r.prompt_token_ids) for r in reqs]
    kind = "Poisson process" if args.burstiness == 1.0 else "gamma-distributed gaps"
    print(f"Traffic request rate: {args.request_rate}\nBurstiness factor: {args.burstiness} ({kind})\n"
          f"Maximum request concurrency: {args.max_concurrency}")
    results, duration = asyncio.run(_benchmark(args, model, reqs, texts))
    result = compute_metrics(results, duration, tokenizer)
    print_report(result, args)
    result.update({"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": args.backend, "model_id": model,
                   "tokenizer_id": tok_source, "endpoint": args.endpoint, "num_prompts": args.num_prompts,
                   "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
                   "burstiness": args.burstiness, "max_concurrency": args.max_concurrency})
    if args.save_result:
        save_result(result, args, Path(model).name)
    return result


def parse(argv: list[str]) -> argparse.Namespace:
    """The `bench serve` arguments alone (for tests and scripts)."""
    parser = argparse.ArgumentParser(prog="ferrollm bench")
    add_serve_bench_parser(parser.add_subparsers(dest="bench_kind", required=True))
    return parser.parse_args(["serve", *argv])
