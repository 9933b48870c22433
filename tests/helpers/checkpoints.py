"""Tiny random checkpoints with a tokenizer, as `LLM(model=folder)` loads them. The fixtures are
registered by the root conftest."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.engine_driver import build_checkpoint

torch.set_num_threads(2)


def _checkpoint(kind: str, folder: Path, tokenizer_dir: Path):
    hf_model = build_checkpoint(kind, folder)
    shutil.copy(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    # transformers wants the plain string form of the special tokens.
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder, hf_model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    return _checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, tokenizer_dir):
    return _checkpoint("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), tokenizer_dir)
