"""Shared fixtures: a tokenizer trained at test time and a deterministic model runner; ferrollm's
caches (the converted tokenizers of GGUF models) go to a temporary folder, never the user's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

# fp32 test checkpoints keep running fp32 under dtype="auto" on CPUs with native bf16 too (greedy
# parity with transformers stays exact); set before any engine or worker process starts.
os.environ.setdefault("FERROLLM_CPU_NATIVE_BF16", "0")

import ferrollm
from helpers.checkpoints import tiny_bert, tiny_llama, tiny_qwen2  # noqa: F401  (fixtures)

CORPUS = [
    "Hello world, the quick brown fox jumps over the lazy dog.",
    "The end. More text follows after the end of the sentence.",
    "你好，世界。今天天气很好。我们去公园散步吧。",
    "Emoji test 🙂 😀 🚀 🎉 and mixed wörds with ümlauts.",
    "Numbers 12345 and symbols #$%&*() appear here too.",
] * 20

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def build_tokenizer_dir(path: Path) -> Path:
    """A byte-level BPE small enough that CJK characters and emoji span several tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]
    )
    trainer = trainers.BpeTrainer(
        vocab_size=380,  # fits the tiny models (vocab 384) that share it
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}})
    )
    return path


@pytest.fixture(scope="session", autouse=True)
def ferrollm_cache_root(tmp_path_factory: pytest.TempPathFactory):
    saved = os.environ.get("FERROLLM_CACHE_ROOT")
    os.environ["FERROLLM_CACHE_ROOT"] = str(tmp_path_factory.mktemp("ferrollm-cache"))
    yield
    if saved is None:
        del os.environ["FERROLLM_CACHE_ROOT"]
    else:
        os.environ["FERROLLM_CACHE_ROOT"] = saved


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_dir(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> ferrollm.Tokenizer:
    return ferrollm.Tokenizer(tokenizer_dir)


VOCAB = 300


def next_tokens(step: ferrollm.SchedulerOutput) -> np.ndarray:
    """Deterministic stand-in for a model: the token depends only on the last scheduled token
    and its position, so batching, chunking and preemption cannot change a request's output.
    Ids 0..2 are the special tokens, never produced."""
    last = step.input_ids[step.logits_indices]
    pos = step.positions[step.logits_indices]
    return (last * 7 + pos * 13 + 1) % VOCAB + 3


def reference_tokens(prompt: list[int], n: int) -> list[int]:
    """What `next_tokens` yields for one request run alone."""
    seq = list(prompt)
    for _ in range(n):
        seq.append((seq[-1] * 7 + (len(seq) - 1) * 13 + 1) % VOCAB + 3)
    return seq[len(prompt):]


def run_engine(engine: ferrollm.EngineCore, runner=next_tokens, max_steps: int = 10_000):
    """Drives the engine to completion; returns (outputs in arrival order, steps)."""
    outputs, steps = [], []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs, steps
        step = engine.schedule()
        steps.append(step)
        sampled = runner(step) if len(step) else np.zeros(0, dtype=np.int64)
        outputs.extend(engine.update(sampled))
    raise AssertionError("engine did not finish")
