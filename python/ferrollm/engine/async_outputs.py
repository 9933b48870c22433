"""The output half of `async_scheduling`: a step's core update (appending the sampled tokens,
detokenizing, stop-token / stop-string / length checks, building the outputs) runs on a
background thread while the caller handles the previous step's outputs.

What overlaps: `EngineCore.update` of step N releases the GIL, so it runs beside the caller's
Python work on step N-1's finished requests (logprobs, `RequestOutput`s, progress bar). What does
not: step N+1 is still scheduled only after step N's update, because ferrollm's Rust scheduler
needs the sampled tokens (and the stop checks) to build the next step; scheduling ahead with
placeholder tokens, as vLLM does, would need the core to schedule before its update.

Invariants: at most one update is in flight; `collect` joins it before anything else touches
the step loop, so the schedule, the model run and the update of a step keep their order and the
outputs are those of the synchronous loop, delivered one `step()` later. Cost: one thread,
started on first use.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from ferrollm._core import EngineCoreOutput


class AsyncOutputs:
    """One core update in flight at a time, on one worker thread."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._inflight: Future[list[EngineCoreOutput]] | None = None

    def busy(self) -> bool:
        """True while an update was started and its outputs not yet collected."""
        return self._inflight is not None

    def start(self, update: Callable[[Any], list[EngineCoreOutput]], sampled: Any) -> None:
        """Runs `update(sampled)` on the worker thread; the previous one must be collected."""
        if self._inflight is not None:
            raise RuntimeError("an update is still in flight: collect it before starting the next")
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrollm-update")
        self._inflight = self._pool.submit(update, sampled)

    def collect(self) -> list[EngineCoreOutput]:
        """Waits for the update in flight and returns its outputs ([] when none is).

        Raises:
            Whatever the update raised (a `CoreError` on a malformed step), in the caller.
        """
        future, self._inflight = self._inflight, None
        return [] if future is None else future.result()

    def drain(self) -> list[EngineCoreOutput]:
        """Like `collect`, but an update's error is dropped (for aborting everything)."""
        try:
            return self.collect()
        except Exception:
            return []

    def close(self) -> None:
        """Waits for the update in flight and stops the thread."""
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
