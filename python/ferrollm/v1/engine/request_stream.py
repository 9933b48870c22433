"""One `AsyncLLM` request's stream: gathers the core's per-step deltas of its `n` sequences and
turns them into vLLM's `RequestOutput`s (cumulative, delta or final-only, per
`SamplingParams.output_kind`), then hands them to the request's asyncio queue.

Owned by the step thread (`apply`, `emit`); the event loop only reads the queue. Cost per step:
the new tokens' text and logprobs, nothing proportional to what was sent before.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from ferrollm._core import EngineCoreOutput
from ferrollm.entrypoints.output_builder import LogprobDecoder, prompt_logprobs
from ferrollm.logprobs import create_sample_logprobs
from ferrollm.outputs import CompletionOutput, RequestOutput
from ferrollm.sampling_params import RequestOutputKind, SamplingParams
from ferrollm.worker.request_state import CachedRequestState

# Put on a queue after a request was aborted: its generator ends without an error.
ABORTED = None


@dataclass
class _Sequence:
    """One of a request's `n` sequences: everything so far, and what is new since the last emit."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: Any = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_text: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: Any = None
    changed: bool = False

    def completion(self, delta: bool) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=self.new_text if delta else self.text,
            token_ids=list(self.new_token_ids if delta else self.token_ids),
            cumulative_logprob=self.cumulative_logprob, logprobs=self.new_logprobs if delta else self.logprobs,
            finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class Delivery:
    """A request's queue on its consumer's event loop, filled from the step thread.

    Args:
        request_id: The caller's id.
        loop: The event loop of the coroutine that consumes `queue`.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    def put(self, item: Any) -> None:
        """Hands an output, an error or `ABORTED` to the consumer's loop (thread-safe); a closed
        loop drops it."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            pass


class RequestStream(Delivery):
    """A request submitted to `AsyncLLM.generate`, from the step thread's side.

    Args:
        request_id: The caller's id.
        prompt: The prompt text, when given as text.
        params: The request's parameters (`n` sequences, `output_kind`, logprobs).
        loop: The event loop of the coroutine that consumes `queue`.
    """

    def __init__(self, request_id: str, prompt: str | None, params: SamplingParams,
                 loop: asyncio.AbstractEventLoop):
        super().__init__(request_id, loop)
        self.prompt = prompt
        self.params = params
        self.seqs = [_Sequence(i) for i in range(params.n)]
        self.prompt_token_ids: list[int] | None = None
        self.prompt_logprobs: Any = None
        self.num_cached_tokens = 0
        # For the server's latency metrics: when it arrived, when its last tokens came, and how
        # many tokens this step brought.
        self.arrival_time = time.perf_counter()
        self.last_token_time: float | None = None
        self.num_step_tokens = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def apply(self, k: int, out: EngineCoreOutput, state: CachedRequestState | None,
              decoder: LogprobDecoder) -> None:
        """Adds sequence `k`'s delta from one step (and its new logprobs, read from `state`)."""
        seq = self.seqs[k]
        if self.prompt_token_ids is None:
            self.prompt_token_ids = list(out.prompt_token_ids)
            self.num_cached_tokens = out.num_cached_tokens
            self.prompt_logprobs = prompt_logprobs(state, decoder)
        start = len(seq.token_ids)
        new_ids = list(out.token_ids)
        seq.token_ids += new_ids
        seq.text += out.text
        seq.new_token_ids += new_ids
        self.num_step_tokens += len(new_ids)
        seq.new_text += out.text
        if out.finished:
            seq.finish_reason, seq.stop_reason = out.finish_reason, out.stop_reason
        seq.changed = True
        if self.params.logprobs is None or state is None or not new_ids:
            return
        entries = state.sample_logprobs[start:len(seq.token_ids)]
        flat = self.params.flat_logprobs
        if seq.logprobs is None:
            seq.logprobs, seq.cumulative_logprob = create_sample_logprobs(flat), 0.0
        decoder.build(entries, seq.token_ids, self.params, seq.logprobs, first=start)
        if self.params.output_kind == RequestOutputKind.DELTA:
            if seq.new_logprobs is None:
                seq.new_logprobs = create_sample_logprobs(flat)
            decoder.build(entries, seq.token_ids, self.params, seq.new_logprobs, first=start)
        seq.cumulative_logprob = (seq.cumulative_logprob or 0.0) + sum(float(e[1][0]) for e in entries)

    def emit(self) -> None:
        """Sends what this step changed, as `output_kind` asks, to the consumer's queue."""
        kind = self.params.output_kind
        finished = self.finished
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return
        delta = kind == RequestOutputKind.DELTA
        seqs = [s for s in self.seqs if s.changed] if delta else self.seqs
        out = RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids or [],
            prompt_logprobs=self.prompt_logprobs, outputs=[s.completion(delta) for s in seqs],
            finished=finished, num_cached_tokens=self.num_cached_tokens)
        for s in self.seqs:
            s.new_text, s.new_token_ids, s.new_logprobs, s.changed = "", [], None, False
        if delta:  # the prompt's logprobs go with the first delta only
            self.prompt_logprobs = None
        self.put(out)


class PoolingStream(Delivery):
    """A request submitted to `AsyncLLM.encode`: one result, delivered when its step ends."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        super().__init__(request_id, loop)
        self.prompt_token_ids: list[int] = []
