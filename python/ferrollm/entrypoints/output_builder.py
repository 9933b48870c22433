"""Turns the core's final outputs (one per sequence) into vLLM's `RequestOutput`s (one per
prompt, with `n` completions), attaching the logprobs the runner gathered."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ferrollm._core import EngineCoreOutput, Tokenizer
from ferrollm.engine.stats import RequestStateStats
from ferrollm.entrypoints.logprob_text import LogprobTextDecoder
from ferrollm.logprobs import (
    PromptLogprobs,
    SampleLogprobs,
    append_logprobs_for_next_position,
    create_prompt_logprobs,
    create_sample_logprobs,
)
from ferrollm.outputs import CompletionOutput, RequestOutput
from ferrollm.sampling_params import SamplingParams
from ferrollm.worker.request_state import CachedRequestState


@dataclass
class PendingRequest:
    """A prompt of one `generate` call waiting for its `n` sequences."""

    request_id: str
    prompt: str | None
    n: int
    completions: dict[int, CompletionOutput] = field(default_factory=dict)
    prompt_token_ids: list[int] | None = None
    prompt_logprobs: list | None = None
    num_cached_tokens: int = 0
    # Each sequence's statistics, when the engine keeps them (disable_log_stats=False).
    metrics: list[RequestStateStats] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.completions) == self.n

    def to_output(self) -> RequestOutput:
        outputs = [self.completions[i] for i in range(self.n)]
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids or [],
            prompt_logprobs=self.prompt_logprobs, outputs=outputs, finished=True,
            num_cached_tokens=self.num_cached_tokens,
            metrics=RequestStateStats.merge(self.metrics) if self.metrics else None,
        )


class LogprobDecoder:
    """Builds vLLM's logprob containers (dict lists, or `FlatLogprobs` when asked) for a
    request's gathered entries.

    Args:
        tokenizer: The core's tokenizer.
        hf_tokenizer: A callable returning the transformers tokenizer (see `LogprobTextDecoder`).
    """

    def __init__(self, tokenizer: Tokenizer | None, hf_tokenizer: Any = None):
        # None with skip_tokenizer_init: no text, as in vLLM.
        self.text = None if tokenizer is None else LogprobTextDecoder(tokenizer, hf_tokenizer)

    def build(self, entries: list[tuple[np.ndarray, np.ndarray, int]], chosen: list[int],
              params: SamplingParams, container: PromptLogprobs | SampleLogprobs, first: int = 0):
        """Appends one position per entry to `container` and returns it.

        Args:
            entries: Per position, (chosen token then top k, their values, the chosen rank).
            chosen: The chosen token of every position so far, this call's included, oldest
                first; position i's own token is `chosen[first + i]`.
            params: The request's parameters (`detokenize`).
            container: A list or `FlatLogprobs`, possibly holding a leading None.
            first: Index in `chosen` of the first entry's token.
        """
        for i, (ids, lps, rank) in enumerate(entries):
            id_list = ids.tolist()
            if params.detokenize and self.text is not None:
                pos = first + i
                texts: Any = self.text.texts(id_list, chosen[max(0, pos - 4):pos])
            else:
                texts = itertools.repeat(None)
            append_logprobs_for_next_position(container, id_list, lps.tolist(), texts, rank)
        return container


def completion(index: int, out: EngineCoreOutput, state: CachedRequestState | None,
               decoder: LogprobDecoder) -> CompletionOutput:
    """One sequence's `CompletionOutput`."""
    logprobs = cumulative = None
    if state is not None and state.params.logprobs is not None:
        entries = state.sample_logprobs[: len(out.token_ids)]
        container = create_sample_logprobs(state.params.flat_logprobs)
        logprobs = decoder.build(entries, list(out.token_ids), state.params, container)
        cumulative = float(sum(float(e[1][0]) for e in entries))
    return CompletionOutput(
        index=index, text=out.text, token_ids=list(out.token_ids), cumulative_logprob=cumulative,
        logprobs=logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason,
    )


def prompt_logprobs(state: CachedRequestState | None, decoder: LogprobDecoder) -> PromptLogprobs | None:
    """vLLM's layout: None for the first prompt token, then one entry per later token. The
    context of a multi-byte token is the prompt from its second token on, as in vLLM."""
    if state is None or state.params.prompt_logprobs is None:
        return None
    container = create_prompt_logprobs(state.params.flat_logprobs)
    return decoder.build(state.prompt_logprobs, state.prompt_token_ids[1:], state.params, container)
