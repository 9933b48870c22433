"""The CPU allocator tuning is applied once, on glibc, and can be switched off."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

SCRIPT = "from ferrollm.worker.cpu_allocator import keep_freed_memory as k; print(k(), k())"


def run(env_value: str | None) -> str:
    env = dict(os.environ)
    env.pop("FERROLLM_CPU_MALLOC_TUNING", None)
    if env_value is not None:
        env["FERROLLM_CPU_MALLOC_TUNING"] = env_value
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip()


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_applied_by_default_on_glibc():
    assert run(None) == "True True"


def test_switched_off_by_the_environment():
    assert run("0") == "False False"
