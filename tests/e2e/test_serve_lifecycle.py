"""`ferrollm serve` when the process is told to stop or loses a worker: each test starts its own
server (the shared one in test_serve.py must stay healthy)."""

from __future__ import annotations

import signal
import threading
import time

import openai
import psutil
import pytest
from helpers.server import get as _get
from helpers.server import start as _start

LONG = {"max_tokens": 100, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


def _stream(client: openai.OpenAI, prompt: str, first_chunk: threading.Event, result: dict) -> None:
    """One streamed completion; ``result`` gets its text chunks, finish reason or error."""
    chunks, finish = [], None
    try:
        for chunk in client.completions.create(model="tiny", prompt=prompt, stream=True, **LONG):
            choice = chunk.choices[0]
            chunks.append(choice.text)
            finish = choice.finish_reason or finish
            first_chunk.set()
        result.update(chunks=chunks, finish=finish)
    except Exception as e:  # noqa: BLE001 - the test asserts on what arrived
        result.update(chunks=chunks, error=e)
    finally:
        result["done_at"] = time.monotonic()
        first_chunk.set()


def _streams(url: str, count: int) -> tuple[list[threading.Thread], list[dict], threading.Event]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    started, results = threading.Event(), [{} for _ in range(count)]
    threads = [threading.Thread(target=_stream, args=(client, f"Request {i} says", started, results[i]))
               for i in range(count)]
    for t in threads:
        t.start()
    assert started.wait(60), "no stream produced a chunk"
    return threads, results, started


def test_sigterm_drains_the_streams_in_flight_then_exits(tiny_llama, tmp_path):
    # vLLM's behaviour: on SIGTERM the server stops taking connections, lets the requests it has
    # finish, and exits cleanly.
    log = tmp_path / "server.log"
    proc, url = _start(tiny_llama[0], log, "--served-model-name", "tiny", "--max-model-len", "128")
    try:
        threads, results, _ = _streams(url, 4)
        stopped_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        # uvicorn re-raises the signal once it has shut down, so the exit is SIGTERM's own.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM), log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    for r in results:
        assert "error" not in r, r
        # Still streaming when the signal came, and finished whole after it.
        assert r["done_at"] > stopped_at and r["finish"] == "length" and len(r["chunks"]) > 50, r
    with pytest.raises(OSError):
        _get(url + "/health")


def test_a_dead_worker_fails_requests_with_500s_naming_it_and_health_turns_unhealthy(tiny_llama, tmp_path):
    log = tmp_path / "server.log"
    proc, url = _start(tiny_llama[0], log, "--served-model-name", "tiny", "--max-model-len", "128",
                       "--tensor-parallel-size", "2")
    try:
        workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                   if "python" in p.name().lower() and p.pid != proc.pid]
        assert workers, "no tensor-parallel worker process found"
        threads, results, _ = _streams(url, 2)
        for w in workers:
            w.kill()
        for t in threads:
            t.join(timeout=120)
        # The streams in flight end with an error event naming the dead rank (their HTTP status
        # was already 200); later requests get a 500 that names it, and /health says 503.
        for r in results:
            assert "error" in r and "worker" in str(r["error"]), r
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        with pytest.raises(openai.InternalServerError) as failed:
            client.completions.create(model="tiny", prompt="After the crash", **LONG)
        assert "worker" in str(failed.value), failed.value
        deadline = time.time() + 30
        while _get(url + "/health")[0] != 503 and time.time() < deadline:
            time.sleep(0.2)
        assert _get(url + "/health")[0] == 503
        assert proc.poll() is None  # the server itself stays up to say so
    finally:
        proc.kill()
        proc.wait(timeout=30)
