"""Requests that exercise every path a tensor-parallel worker must mirror: prompts of several
lengths, a shared prefix (prefix caching), prompt logprobs (extra logits gathers on every rank)
and a seeded sampled request (only rank 0 samples)."""

from __future__ import annotations

from ferrollm import LLM, SamplingParams

PREFIX = list(range(3, 40))
PROMPTS = [
    {"prompt_token_ids": [5, 6, 7]},
    {"prompt_token_ids": list(range(10, 27))},
    {"prompt_token_ids": PREFIX + [200, 201]},
    {"prompt_token_ids": PREFIX + [300, 301, 302, 303, 304]},
    {"prompt_token_ids": list(range(100, 160))},
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PARAMS = [GREEDY, GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2),
          SamplingParams(temperature=0.8, seed=11, max_tokens=5, ignore_eos=True)]


def run(llm: LLM) -> tuple[list[list[int]], list]:
    """Token ids of each request and the prompt logprobs of the one that asks."""
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], outs[3].prompt_logprobs


def assert_same(a: tuple[list[list[int]], list], b: tuple[list[list[int]], list]) -> None:
    assert a[0] == b[0]
    for x, y in zip(a[1][1:], b[1][1:], strict=True):
        assert x.keys() == y.keys()
        for tok in x:
            assert abs(x[tok].logprob - y[tok].logprob) < 1e-4
