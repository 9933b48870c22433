"""Output tokens/s with and without `async_scheduling`, alternating A and B runs (the box is
shared: a load spike then hits both, and which goes first alternates) on one engine each, random-token prompts, greedy decoding
with a stop string (so the update runs its stop-string scan) and `max_tokens` ends.

    python benches/async_scheduling.py [--model .bench/qwen2-0.5b] [--prompts 32] [--tokens 64] [--rounds 3]

Without --model, a small Qwen2 (hidden 128, 2 layers) with make_checkpoint's 152k-word vocabulary
is written to a temporary folder: a model whose run is short, so the per-step work around it
(the part `async_scheduling` overlaps) weighs most.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from ferrollm import LLM, SamplingParams


def small_checkpoint(folder: Path) -> Path:
    from make_checkpoint import VOCAB, write_tokenizer
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         intermediate_size=256, vocab_size=VOCAB, max_position_embeddings=4096,
                         tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    write_tokenizer(folder)
    return folder


def run(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outs)


class _TimedCore:
    """Stands in for an engine's core and sums the time of its schedule and update calls."""

    def __init__(self, core) -> None:
        self._core = core
        self.seconds = {"schedule": 0.0, "update": 0.0}

    def __getattr__(self, name):
        return getattr(self._core, name)

    def schedule(self):
        start = time.perf_counter()
        out = self._core.schedule()
        self.seconds["schedule"] += time.perf_counter() - start
        return out

    def update(self, sampled):
        start = time.perf_counter()
        out = self._core.update(sampled)
        self.seconds["update"] += time.perf_counter() - start
        return out


def breakdown(llm: LLM, prompts: list[dict], params: SamplingParams) -> str:
    """How much of a run the core's schedule and update take: the most overlap could hide."""
    engine = llm.llm_engine
    timed = _TimedCore(engine.core)
    engine.core = timed
    try:
        secs, _ = run(llm, prompts, params)
    finally:
        engine.core = timed._core
    parts = ", ".join(f"{k} {v * 1e3:.1f} ms ({100 * v / secs:.2f}%)" for k, v in timed.seconds.items())
    return f"default loop, {secs * 1e3:.0f} ms in all: {parts}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(small_checkpoint(Path(tmp.name)))
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (32,), generator=g).tolist()} for _ in range(args.prompts)]
    # "t7 " rarely appears: most requests run to max_tokens, but every step scans for it.
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True, stop=["t7 t7"])
    llms = {flag: LLM(model=model, max_model_len=512, async_scheduling=flag) for flag in (False, True)}
    for llm in llms.values():
        run(llm, prompts[:2], params)  # warm-up
    totals = {False: [0.0, 0], True: [0.0, 0]}
    for r in range(args.rounds):
        for flag in (False, True) if r % 2 == 0 else (True, False):  # alternate which goes first
            llm = llms[flag]
            secs, toks = run(llm, prompts, params)
            totals[flag][0] += secs
            totals[flag][1] += toks
            print(f"round {r} async_scheduling={flag}: {toks / secs:8.1f} tok/s  loadavg {os.getloadavg()[0]:.2f}")
    for flag, (secs, toks) in totals.items():
        print(f"async_scheduling={flag}: {toks / secs:8.1f} tok/s over {args.rounds} rounds")
    print(breakdown(llms[False], prompts, params), f"loadavg {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
