"""Turns the core's final outputs (one per sequence) into vLLM's `RequestOutput`s (one per
prompt, with `n` completions), attaching the logprobs the runner gathered."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ferrollm._core import EngineCoreOutput, Tokenizer
from ferrollm.engine.stats import RequestStateStats
from ferrollm.outputs import CompletionOutput, Logprob, RequestOutput
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
    """Builds vLLM's logprob dicts, decoding each token once."""

    def __init__(self, tokenizer: Tokenizer | None):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def text(self, token_id: int) -> str | None:
        if self.tokenizer is None:  # skip_tokenizer_init: no text, as in vLLM
            return None
        if token_id not in self._cache:
            self._cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return self._cache[token_id]

    def entry(self, ids: np.ndarray, lps: np.ndarray, rank: int) -> dict[int, Logprob]:
        """The sampled (or prompt) token first with its rank, then the top tokens by rank."""
        d: dict[int, Logprob] = {}
        for j, (tid, lp) in enumerate(zip(ids.tolist(), lps.tolist())):
            if tid not in d:
                d[tid] = Logprob(logprob=lp, rank=rank if j == 0 else j, decoded_token=self.text(tid))
        return d


def completion(index: int, out: EngineCoreOutput, state: CachedRequestState | None,
               decoder: LogprobDecoder) -> CompletionOutput:
    """One sequence's `CompletionOutput`."""
    logprobs = cumulative = None
    if state is not None and state.params.logprobs is not None:
        entries = state.sample_logprobs[: len(out.token_ids)]
        logprobs = [decoder.entry(*e) for e in entries]
        cumulative = float(sum(float(e[1][0]) for e in entries))
    return CompletionOutput(
        index=index, text=out.text, token_ids=list(out.token_ids), cumulative_logprob=cumulative,
        logprobs=logprobs, finish_reason=out.finish_reason, stop_reason=out.stop_reason,
    )


def prompt_logprobs(state: CachedRequestState | None, decoder: LogprobDecoder) -> list | None:
    """vLLM's layout: None for the first prompt token, then one dict per later token."""
    if state is None or state.params.prompt_logprobs is None:
        return None
    return [None] + [decoder.entry(*e) for e in state.prompt_logprobs]
