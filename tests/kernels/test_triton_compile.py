"""Every Triton kernel compiles for sm_90 (H100), and the quantized ones for sm_80 (A100, no
float8 units: the e4m3 decoding path) too, with no GPU present.

The interpreter tests check what the kernels compute; this checks that the GPU compiler accepts
them (``tl.dot`` shape rules, dtypes, ops the interpreter emulates but the compiler lacks). It runs
in a subprocess because the interpreter, once on in this process, replaces the compiler. About
30 s the first time on two cores; later runs hit Triton's cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def compile_kernels(*args: str) -> list[str]:
    """Runs ``helpers.triton_compile`` with ``args``; returns its lines for compiled launches."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS.parent / "python"), env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns when it is unset
    result = subprocess.run([sys.executable, "-m", "helpers.triton_compile", *args], cwd=TESTS, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    return [line for line in result.stdout.splitlines() if ": ok," in line]


def test_all_kernels_compile_for_sm90():
    compiled = compile_kernels("90")
    # 15 layer and attention launches, 36 quantized ones (matmuls with their quantizer launches,
    # and the split-K sum after each of the 9 decode-shaped matmuls).
    assert len(compiled) == 51, "\n".join(compiled)


def test_quantized_kernels_compile_for_sm80():
    compiled = compile_kernels("--quant", "80")
    assert len(compiled) == 36, "\n".join(compiled)
