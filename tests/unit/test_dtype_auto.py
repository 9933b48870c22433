"""`dtype="auto"` on the CPU: the checkpoint's precision kept where it is bf16 or fp16 (as bf16),
fp32 kept fp32 unless the CPU has native bf16 dot products, an explicit dtype always winning,
and the choice logged with its reason."""

from __future__ import annotations

import logging

import pytest
import torch
from ferrollm.config import model_config
from ferrollm.config.model_config import resolve_dtype

CPU = torch.device("cpu")


@pytest.mark.parametrize(("checkpoint", "native", "want"), [
    (torch.bfloat16, False, torch.bfloat16),
    ("bfloat16", False, torch.bfloat16),
    (torch.float16, False, torch.bfloat16),
    (torch.float32, False, torch.float32),
    ("float32", True, torch.bfloat16),
    (None, False, torch.float32),
])
def test_auto_follows_the_checkpoint_and_the_cpu(monkeypatch, caplog, checkpoint, native, want):
    monkeypatch.setenv("FERROLLM_CPU_NATIVE_BF16", "1" if native else "0")
    with caplog.at_level(logging.INFO, logger="ferrollm.config.model_config"):
        assert resolve_dtype("auto", checkpoint, CPU) == want
    line = caplog.records[-1].getMessage()
    assert f"dtype='auto' resolved to {str(want).removeprefix('torch.')} on the CPU" in line
    assert ("has native bf16" in line) == (native and checkpoint in ("float32", torch.float32))


@pytest.mark.parametrize("checkpoint", [torch.bfloat16, torch.float16, torch.float32])
def test_an_explicit_float32_wins(monkeypatch, checkpoint):
    monkeypatch.setenv("FERROLLM_CPU_NATIVE_BF16", "1")
    assert resolve_dtype("float32", checkpoint, CPU) == torch.float32


def test_native_bf16_is_read_from_the_cpu_flags(monkeypatch):
    monkeypatch.delenv("FERROLLM_CPU_NATIVE_BF16", raising=False)
    monkeypatch.setattr(model_config, "_cpu_flags", lambda: frozenset({"avx2", "amx_bf16"}))
    assert model_config.cpu_has_native_bf16()
    monkeypatch.setattr(model_config, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert not model_config.cpu_has_native_bf16()

