"""`cancel_on_disconnect`: a non-streamed request's work is cancelled (so its engine requests
are aborted) when the client leaves first, and returned untouched otherwise."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("fastapi")

from ferrollm.entrypoints.openai.api_server import cancel_on_disconnect  # noqa: E402


class _Request:
    def __init__(self, leaves_after: float | None):
        self.leaves_after = leaves_after

    async def receive(self) -> dict:
        if self.leaves_after is None:
            await asyncio.Event().wait()  # never
        await asyncio.sleep(self.leaves_after)
        return {"type": "http.disconnect"}


def test_a_client_that_leaves_cancels_the_work():
    cancelled = asyncio.Event()

    async def work():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def main():
        response = await cancel_on_disconnect(_Request(0.01), work())
        await asyncio.wait_for(cancelled.wait(), 1)
        return response

    assert asyncio.run(main()).status_code == 499


def test_work_that_finishes_first_returns_its_result():
    async def work():
        return {"ok": True}

    assert asyncio.run(cancel_on_disconnect(_Request(None), work())) == {"ok": True}


def test_the_works_error_propagates():
    async def work():
        raise ValueError("`n` must be >= 1")

    with pytest.raises(ValueError):
        asyncio.run(cancel_on_disconnect(_Request(None), work()))
