"""`LLM.beam_search`: vLLM's offline beam search on top of `generate`.

Each step runs every live beam of every prompt as a one-token request asking for the top
`2 * beam_width` logprobs (transformers' candidate count); each candidate extends its beam by one
token, a candidate ending in EOS finishes (unless `ignore_eos`), and each prompt keeps its
`beam_width` best live beams by score. After `max_tokens` steps (or when no beam is live) the
finished and live beams are ranked together and the best `beam_width` returned.

Costs: one `generate` call per token step; a beam's prompt and tokens so far are re-sent each
step, and prefix caching turns that into one new token of compute per beam when it is on.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

from ferrollm.beam_search import (
    BeamSearchInstance,
    BeamSearchOutput,
    BeamSearchSequence,
    create_sort_beams_key_function,
)
from ferrollm.entrypoints.prompts import normalize_prompts
from ferrollm.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:
    from ferrollm.entrypoints.llm import LLM

__all__ = ["beam_search"]


def beam_search(llm: LLM, prompts: Any, params: BeamSearchParams, use_tqdm: bool = False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """See `LLM.beam_search`."""
    engine = llm._engine()
    core_tok = engine.tokenizers.core
    eos = set(core_tok.eos_token_ids)
    sort_key = create_sort_beams_key_function(eos, params.length_penalty)
    instances = []
    for orig, (_, prompt) in zip(_as_list(prompts), normalize_prompts(prompts, engine.vocab_size)):
        ids = core_tok.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else prompt
        instances.append(BeamSearchInstance(ids, orig))
    step_params = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature,
                                 detokenize=False, ignore_eos=True)
    limit = concurrency_limit or max(len(instances), 1)
    for start in range(0, len(instances), limit):
        batch = instances[start:start + limit]
        steps = range(params.max_tokens)
        if use_tqdm:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="Beam search", unit="token")
        for _ in steps:
            if not _step(llm, batch, step_params, params, eos, sort_key):
                break
    outputs = []
    for inst in instances:
        best = sorted(inst.completed + inst.beams, key=sort_key, reverse=True)[: params.beam_width]
        for beam in best:
            beam.text = core_tok.decode(beam.tokens, skip_special_tokens=params.skip_special_tokens)
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs


def _step(llm: LLM, batch: list[BeamSearchInstance], step_params: SamplingParams, params: BeamSearchParams,
          eos: set[int], sort_key) -> bool:
    """Extends every live beam by one token; False when no prompt had a live beam."""
    beams = list(itertools.chain.from_iterable(inst.beams for inst in batch))
    if not beams:
        return False
    results = llm.generate([{"prompt_token_ids": b.tokens} for b in beams], step_params, use_tqdm=False)
    bounds = list(itertools.accumulate((len(inst.beams) for inst in batch), initial=0))
    for inst, lo, hi in zip(batch, bounds[:-1], bounds[1:]):
        candidates = []
        for beam, result in zip(beams[lo:hi], results[lo:hi]):
            entry = result.outputs[0].logprobs[0]
            for token_id, lp in entry.items():
                new = BeamSearchSequence(tokens=beam.tokens + [token_id], logprobs=beam.logprobs + [entry],
                                         cum_logprob=beam.cum_logprob + lp.logprob, orig_prompt=beam.orig_prompt)
                if token_id in eos and not params.ignore_eos:
                    inst.completed.append(new)
                else:
                    candidates.append(new)
        inst.beams = sorted(candidates, key=sort_key, reverse=True)[: params.beam_width]
    return True


def _as_list(prompts: Any) -> list[Any]:
    return [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
