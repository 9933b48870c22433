"""Per-request timing (`RequestOutput.metrics`) and the periodic throughput log line, kept when
an engine is built with ``disable_log_stats=False`` (`LLM` defaults to True, as vLLM's does).

The tracker reads each step's arrays after the step ran: the rows that sampled a token, the
requests scheduled for the first time and the preempted ones. Its cost is a Python loop over
the step's sampling rows, paid only when statistics are on.

Timestamps follow vLLM's `RequestStateStats`: `arrival_time` is wall-clock (`time.time()`), the
others are `time.monotonic()`.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass

import numpy as np

from ferrollm._core import EngineCore, SchedulerOutput

logger = logging.getLogger("ferrollm.stats")

# Seconds between throughput lines (vLLM's VLLM_LOG_STATS_INTERVAL; the same default).
LOG_INTERVAL_ENV = ("FERROLLM_LOG_STATS_INTERVAL", "VLLM_LOG_STATS_INTERVAL")


@dataclass
class RequestStateStats:
    """vLLM's per-request statistics (`vllm.v1.metrics.stats.RequestStateStats`).

    Attributes:
        num_generation_tokens: tokens sampled for the request.
        num_preemptions: times the scheduler preempted it.
        arrival_time: wall-clock time the request was added.
        queued_ts: monotonic time it entered the waiting queue.
        scheduled_ts: monotonic time it was first scheduled.
        first_token_ts: monotonic time of its first sampled token.
        last_token_ts: monotonic time of its last sampled token.
        first_token_latency: seconds from arrival to the first token.
        is_corrupted: always False (ferrollm does not check logits for NaNs).
    """

    num_generation_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0
    is_corrupted: bool = False

    @staticmethod
    def merge(parts: list[RequestStateStats]) -> RequestStateStats:
        """One prompt's statistics from its `n` sequences: the earliest start, the latest end and
        the summed counts."""
        first = parts[0]
        firsts = [p.first_token_ts for p in parts if p.first_token_ts]
        return RequestStateStats(
            num_generation_tokens=sum(p.num_generation_tokens for p in parts),
            num_preemptions=sum(p.num_preemptions for p in parts),
            arrival_time=first.arrival_time, queued_ts=first.queued_ts,
            scheduled_ts=min((p.scheduled_ts for p in parts if p.scheduled_ts), default=0.0),
            first_token_ts=min(firsts, default=0.0),
            last_token_ts=max(p.last_token_ts for p in parts),
            first_token_latency=min((p.first_token_latency for p in parts if p.first_token_ts), default=0.0),
        )


class StatsTracker:
    """Per-request statistics of one engine, and its throughput log."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestStateStats] = {}
        self._id_of: dict[int, str] = {}  # the core's request index -> request id
        self._interval = float(next((os.environ[k] for k in LOG_INTERVAL_ENV if k in os.environ), 10.0))
        self._last_log = time.monotonic()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    def on_add(self, request_ids: list[str]) -> None:
        wall, mono = time.time(), time.monotonic()
        for rid in request_ids:
            self.requests[rid] = RequestStateStats(arrival_time=wall, queued_ts=mono)

    def on_step(self, step: SchedulerOutput, core: EngineCore) -> None:
        """Records a step that has run: who was scheduled, preempted and sampled."""
        now = time.monotonic()
        for new in step.scheduled_new_reqs:
            self._id_of[new.req_index] = new.request_id
            stats = self.requests.get(new.request_id)
            if stats is not None and not stats.scheduled_ts:
                stats.scheduled_ts = now
        for idx in step.preempted_req_indices.tolist():
            stats = self.requests.get(self._id_of.get(idx, ""))
            if stats is not None:
                stats.num_preemptions += 1
        sampled = step.req_indices[np.asarray(step.needs_sample, dtype=bool)].tolist()
        num_decodes = 0
        for idx in sampled:
            stats = self.requests.get(self._id_of.get(idx, ""))
            if stats is None:
                continue
            if stats.first_token_ts:
                num_decodes += 1
            else:
                stats.first_token_ts = now
                stats.first_token_latency = time.time() - stats.arrival_time
            stats.last_token_ts = now
            stats.num_generation_tokens += 1
        self._num_prompt_tokens += step.total_num_scheduled_tokens - num_decodes
        self._num_generation_tokens += len(sampled)
        if now - self._last_log >= self._interval:
            self.log(core, now)

    def pop(self, request_id: str) -> RequestStateStats | None:
        """A finished request's statistics (forgotten here)."""
        return self.requests.pop(request_id, None)

    def log(self, core: EngineCore, now: float | None = None) -> None:
        """Logs throughput since the last line, as vLLM's LoggingStatLogger does."""
        now = time.monotonic() if now is None else now
        elapsed = max(now - self._last_log, 1e-9)
        s = core.stats()
        logger.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            self._num_prompt_tokens / elapsed, self._num_generation_tokens / elapsed, s["num_running"],
            s["num_waiting"], 100 * float(s["kv_cache_usage"]), 100 * float(s["prefix_cache_hit_rate"]))
        self._last_log, self._num_prompt_tokens, self._num_generation_tokens = now, 0, 0
