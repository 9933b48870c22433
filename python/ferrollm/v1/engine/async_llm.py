"""`AsyncLLM`: vLLM's asyncio engine. Coroutines submit requests and iterate their outputs as
tokens arrive, while one step thread drives the `LLMEngine` (schedule in Rust, execute in torch,
update in Rust).

Why a thread and not the core's tokio `AsyncEngine`: that loop calls a Rust `ModelRunner`, and
ours is Python + torch. The thread owns the engine: requests and aborts reach it as commands it
runs between steps, so the engine needs no lock. The core calls and torch's kernels release the
GIL, so the event loop keeps serving while a step runs. Each request's outputs go to its own
unbounded asyncio queue: a slow consumer only lets its own queue grow, it never stalls a step.

A step that raises fails the requests it held (each generator raises the cause); the thread
lives on and serves later requests, unless the engine is dead (a tensor-parallel worker died:
later requests then fail with `EngineDeadError`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from ferrollm.engine.arg_utils import EngineArgs
from ferrollm.engine.llm_engine import LLMEngine
from ferrollm.entrypoints.llm import _fan_out
from ferrollm.entrypoints.output_builder import LogprobDecoder
from ferrollm.entrypoints.prompts import multimodal_fields, normalize_prompts
from ferrollm.exceptions import InvalidRequestError
from ferrollm.multimodal.requests import process_multimodal
from ferrollm.outputs import PoolingOutput, PoolingRequestOutput, RequestOutput
from ferrollm.pooling_params import PoolingParams
from ferrollm.sampling_params import RequestOutputKind, SamplingParams
from ferrollm.v1.engine.request_stream import ABORTED, Delivery, PoolingStream, RequestStream

logger = logging.getLogger("ferrollm")
_NOTHING = object()


@dataclass(frozen=True)
class _Submission:
    """What the step thread needs to add one request: its normalized prompt, its multimodal
    fields (processed there, off the event loop) and how to tokenize it."""

    items: list
    fields: list
    priority: int
    add_special_tokens: bool


class AsyncLLM:
    """An engine for asyncio servers. Build it with `AsyncLLM.from_engine_args`.

    Args:
        engine: A loaded engine whose core streams outputs (`LLMEngine.from_args(...,
            stream_outputs=True)`).
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.model_config = engine.model_config
        self._decoder = LogprobDecoder(engine.tokenizers.core, lambda: engine.tokenizers.hf)
        self._streams: dict[str, RequestStream] = {}  # by request id; step thread only
        self._pooling: dict[str, PoolingStream] = {}  # pooling requests, by request id
        self._seq_parent: dict[str, tuple[int, str]] = {}  # sequence id -> (index, request id)
        self._commands: list[Callable[[], None]] = []
        self._cv = threading.Condition()
        self._stopping = False
        # Latency and token metrics (the server's `StatLogger`), fed from the step thread.
        self.stat_logger: Any = None
        self._thread = threading.Thread(target=self._run, name="ferrollm-step-loop", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **_: Any) -> AsyncLLM:
        """Loads the model and starts the step thread (vLLM's extra keywords are accepted).
        A pooling model (``runner="pooling"``) serves `encode` instead of `generate`."""
        return cls(LLMEngine.from_args(engine_args, stream_outputs=True))

    # -- the caller's side (event loop) -------------------------------------------------------

    async def generate(self, prompt: Any, sampling_params: SamplingParams | None, request_id: str,
                       *, priority: int = 0, tokenization_kwargs: dict[str, Any] | None = None,
                       **_: Any) -> AsyncGenerator[RequestOutput, None]:
        """Submits one prompt and yields its `RequestOutput`s as tokens arrive.

        Args:
            prompt: A string, `{"prompt": ...}` or `{"prompt_token_ids": [...]}`, either dict
                with `multi_modal_data` (and `mm_processor_kwargs`) as `LLM.generate` takes them;
                its images are processed on the step thread.
            sampling_params: The request's parameters (None: the model's defaults). Its
                `output_kind` picks cumulative outputs, deltas or the final output only.
            request_id: Unique among running requests.
            priority: Lower runs first under `scheduling_policy="priority"`.
            tokenization_kwargs: `{"add_special_tokens": False}` for a text that already holds
                them (a rendered chat template), as in vLLM.

        Yields:
            `RequestOutput`s; the last has `finished=True`. Closing the generator early (or
            cancelling its task) aborts the request; `abort` from elsewhere ends it quietly.

        Raises:
            InvalidRequestError: a bad prompt or parameters, or a request id already running.
            Exception: whatever failed the step that held this request.
        """
        add_special = bool((tokenization_kwargs or {}).get("add_special_tokens", True))
        stream = self._submit(prompt, sampling_params, request_id, priority, add_special)
        aggregate = stream.params.output_kind == RequestOutputKind.DELTA
        finished = False
        leftover: Any = _NOTHING
        try:
            while True:
                item = await stream.queue.get() if leftover is _NOTHING else leftover
                leftover = _NOTHING
                # A slow consumer gets what piled up as one output, not a backlog (as in vLLM).
                while isinstance(item, RequestOutput) and not item.finished and not stream.queue.empty():
                    nxt = stream.queue.get_nowait()
                    if not isinstance(nxt, RequestOutput):
                        leftover = nxt
                        break
                    item.add(nxt, aggregate)
                if item is ABORTED:
                    return
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    async def encode(self, prompt: Any, pooling_params: PoolingParams | None, request_id: str, *,
                     pooling_task: str = "embed", truncate_prompt_tokens: int | None = None,
                     **_: Any) -> AsyncGenerator[PoolingRequestOutput, None]:
        """Pools one prompt's hidden states (a model built with ``runner="pooling"``).

        Args:
            prompt: As in `generate`.
            pooling_params: ``normalize``, ``dimensions``, ...; None for the model's defaults.
            request_id: Unique among running requests.
            pooling_task: ``"embed"`` or ``"token_embed"`` (as `LLM.encode`).
            truncate_prompt_tokens: Keep only the last ``k`` tokens (-1: ``max_model_len``).

        Yields:
            One finished `PoolingRequestOutput` (``outputs.data`` a float32 CPU tensor).
        """
        from ferrollm.entrypoints.pooling import _expand_params

        if not self.engine.model_config.is_pooling:
            raise InvalidRequestError("AsyncLLM.encode() needs a pooling model (runner='pooling'); this engine "
                                      f"runs {self.engine.model_config.architecture} as a generative model")
        items = normalize_prompts(prompt, self.engine.vocab_size)
        if len(items) != 1:
            raise InvalidRequestError(f"`prompt` must be one prompt. Given: {len(items)}")
        params = _expand_params(pooling_params, 1, pooling_task, truncate_prompt_tokens, self.engine)
        stream = PoolingStream(request_id, asyncio.get_running_loop())
        self._send(lambda: self._add_pooling(stream, items, params))
        item = ABORTED
        try:
            item = await stream.queue.get()
        finally:
            if item is ABORTED:
                self.abort(request_id)
        if isinstance(item, BaseException):
            raise item
        if item is not ABORTED:
            yield item

    def abort(self, request_id: str | list[str]) -> None:
        """Aborts requests (unknown or finished ids are ignored); their KV blocks are freed before
        the next step and their generators end."""
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if not self._stopping:  # after shutdown every request has ended already
            self._send(lambda: self._abort(ids))

    async def get_tokenizer(self) -> Any:
        """The model's transformers tokenizer."""
        return self.engine.tokenizers.hf

    def get_default_sampling_params(self) -> SamplingParams:
        """The model's generation_config.json fields over vLLM's defaults (as `LLM`'s)."""
        return SamplingParams(**self.engine.default_sampling_fields)

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def errored(self) -> bool:
        try:
            self.engine.check_alive()
        except Exception:
            return True
        return not self._thread.is_alive()

    async def check_health(self) -> None:
        """Raises when the engine can no longer serve (a dead worker or a stopped step thread)."""
        self.engine.check_alive()
        if not self._thread.is_alive():
            raise RuntimeError("the AsyncLLM step thread is not running")

    def shutdown(self) -> None:
        """Stops the step thread (in-flight requests end as aborted) and releases the engine."""
        with self._cv:
            if self._stopping:
                return
            self._stopping = True
            self._cv.notify()
        self._thread.join()
        deliveries: list[Delivery] = [*self._streams.values(), *self._pooling.values()]
        for stream in deliveries:
            stream.put(ABORTED)
        self._streams.clear()
        self._pooling.clear()
        self.engine.close()

    def _submit(self, prompt: Any, params: SamplingParams | None, request_id: str, priority: int,
                add_special_tokens: bool = True) -> RequestStream:
        if self.engine.model_config.is_pooling:
            from ferrollm.entrypoints.llm import _not_generative

            raise InvalidRequestError(_not_generative(self.engine))
        items = normalize_prompts(prompt, self.engine.vocab_size)
        if len(items) != 1:
            raise InvalidRequestError(f"`prompt` must be one prompt. Given: {len(items)}")
        params = params if params is not None else self.get_default_sampling_params()
        stream = RequestStream(request_id, items[0][0], params, asyncio.get_running_loop())
        request = _Submission(items, multimodal_fields(prompt), priority, add_special_tokens)
        self._send(lambda: self._add(stream, request))
        return stream

    def _send(self, command: Callable[[], None]) -> None:
        with self._cv:
            if self._stopping:
                raise RuntimeError("this AsyncLLM has been shut down")
            self._commands.append(command)
            self._cv.notify()

    # -- the step thread's side ---------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        while True:
            with self._cv:
                while not (self._commands or self._stopping or engine.has_unfinished_requests()):
                    self._cv.wait()
                if self._stopping:
                    return
                commands, self._commands = self._commands, []
            for command in commands:
                try:
                    command()
                except Exception:  # a bug in one command must not stop every request's steps
                    logger.exception("an AsyncLLM command failed")
            if not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except BaseException as e:  # the engine aborted everything; the loop lives on
                logger.exception("a step failed; failing its %d requests", len(self._streams))
                self._fail_all(e)
                continue
            self._dispatch(outputs)

    def _add(self, stream: RequestStream, request: _Submission) -> None:
        rid = stream.request_id
        if rid in self._streams:
            stream.put(InvalidRequestError(f"`request_id` must be unique among running requests. Given: {rid!r}"))
            return
        children = _fan_out(stream.params)
        seq_ids = [rid] if len(children) == 1 else [f"{k}_{rid}" for k in range(len(children))]
        n, special = len(seq_ids), request.add_special_tokens
        try:
            mm = process_multimodal(self.engine, request.items, request.fields, special)[0]
            self.engine.add_requests(seq_ids, [request.items[0][1]] * n, children, special, [request.priority] * n,
                                     mm_inputs=None if mm is None else [mm] * n)
        except Exception as e:  # a bad request fails its own generator only
            stream.put(e)
            return
        self._streams[rid] = stream
        for k, sid in enumerate(seq_ids):
            self._seq_parent[sid] = (k, rid)

    def _add_pooling(self, stream: PoolingStream, items: list, params: list[PoolingParams]) -> None:
        from ferrollm.entrypoints.pooling import _tokenize

        rid = stream.request_id
        if rid in self._pooling:
            stream.put(InvalidRequestError(f"`request_id` must be unique among running requests. Given: {rid!r}"))
            return
        try:
            stream.prompt_token_ids = _tokenize(self.engine, items, params)[0]
            self.engine.add_pooling_requests([rid], [stream.prompt_token_ids], params)
        except Exception as e:
            stream.put(e)
            return
        self._pooling[rid] = stream

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            pooled = self._pooling.pop(rid, None)
            if pooled is not None:
                self.engine.core.abort_requests([rid])
                self.engine.pooling_runner.release(rid)
                self._drop_stats(rid)
                pooled.put(ABORTED)
            stream = self._streams.pop(rid, None)
            if stream is None:
                continue
            seq_ids = [sid for sid, (_, parent) in self._seq_parent.items() if parent == rid]
            self.engine.core.abort_requests(seq_ids)
            logger.info("aborted request %s", rid)
            for sid in seq_ids:
                del self._seq_parent[sid]
                self._drop_stats(sid)
                # Drops parameters of a request never scheduled; a scheduled one's state goes
                # with the next step's finished indices.
                self.engine.generation_runner.release(sid)
            stream.put(ABORTED)

    def _dispatch(self, outputs: list[Any]) -> None:
        if self.engine.model_config.is_pooling:
            self._dispatch_pooled(outputs)
            return
        runner = self.engine.generation_runner
        touched: dict[str, RequestStream] = {}
        for out in outputs:
            sid = out.request_id
            if out.finished:
                state = runner.release(sid)
                self._drop_stats(sid)
                parent = self._seq_parent.pop(sid, None)
            else:
                state = runner.state_of(sid)
                parent = self._seq_parent.get(sid)
            if parent is None:  # aborted since: its final "abort" output has no consumer
                continue
            k, rid = parent
            stream = self._streams[rid]
            stream.apply(k, out, state, self._decoder)
            touched[rid] = stream
        now = time.perf_counter()
        for rid, stream in touched.items():
            if self.stat_logger is not None:
                self._record(stream, now)
            stream.emit()
            if stream.finished:
                del self._streams[rid]

    def _dispatch_pooled(self, outputs: list[Any]) -> None:
        for out in outputs:
            pooled = self.engine.pooling_runner.release(out.request_id)
            self._drop_stats(out.request_id)
            stream = self._pooling.pop(out.request_id, None)
            if stream is not None and pooled is not None:
                stream.put(PoolingRequestOutput(stream.request_id, PoolingOutput(pooled), stream.prompt_token_ids,
                                                0, True))

    def _drop_stats(self, seq_id: str) -> None:
        """Forgets a finished sequence's timing (the engine's throughput log keeps its counts)."""
        if self.engine.stats is not None:
            self.engine.stats.pop(seq_id)

    def _record(self, stream: RequestStream, now: float) -> None:
        since_last = None if stream.last_token_time is None else now - stream.last_token_time
        self.stat_logger.on_tokens(stream.num_step_tokens, now - stream.arrival_time, since_last,
                                   len(stream.prompt_token_ids or []))
        stream.last_token_time, stream.num_step_tokens = now, 0
        if stream.finished:
            self.stat_logger.on_finished([s.finish_reason for s in stream.seqs], now - stream.arrival_time)

    def _fail_all(self, error: BaseException) -> None:
        deliveries: list[Delivery] = [*self._streams.values(), *self._pooling.values()]
        for stream in deliveries:
            stream.put(error)
        self._streams.clear()
        self._pooling.clear()
        self._seq_parent.clear()
