"""A real `ferrollm serve` process on 127.0.0.1 for end-to-end tests (the serve and bench-serve
tests), and a plain-HTTP GET for the routes the `openai` client does not cover."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url: str, key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def start(model: Path, log: Path, *flags: str):
    """A server process for `model`, once /health answers 200; returns (process, base URL)."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2] / "python"),
                                                         os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ferrollm.cli", "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
         "--uvicorn-log-level", "warning", *flags], env=env, stderr=log.open("w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 90
    while time.time() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if get(url + "/health")[0] == 200:
                return proc, url
        except OSError:
            time.sleep(0.2)
    proc.kill()
    pytest.fail("the server did not become healthy in 90 s")
