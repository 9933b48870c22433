"""Tiny random checkpoints with a tokenizer, as `LLM(model=folder)` loads them."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers.engine_driver import build_checkpoint

torch.set_num_threads(2)


def _checkpoint(kind: str, folder: Path, tokenizer_dir: Path):
    hf_model = build_checkpoint(kind, folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, folder / name)
    return folder, hf_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    return _checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, tokenizer_dir):
    return _checkpoint("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), tokenizer_dir)
