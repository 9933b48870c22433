"""A GGUF model's tokenizer: converted by transformers once, then read from the cache, which is
keyed by the file's metadata and gives the same tokenizers as the conversion."""

from __future__ import annotations

import logging
import shutil

import pytest
from helpers.gguf_files import write_gguf

from ferrollm.config.model_source import ModelSource
from ferrollm.engine import gguf_tokenizer
from ferrollm.engine.tokenizer_loader import load_tokenizers

TEXTS = ["the cat sat on the mat", "<|im_start|>user\nhi<|im_end|>", "naïve 🙂"]
CHAT = [{"role": "user", "content": "the cat"}]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("FERROLLM_CACHE_ROOT", str(root))
    return root


def _load(path):
    return load_tokenizers(ModelSource(folder=path.parent, gguf_file=path), None)


def _never_convert(monkeypatch):
    def fail(gguf_file):
        raise AssertionError(f"{gguf_file} was converted again")

    monkeypatch.setattr(gguf_tokenizer, "_convert", fail)


def test_second_load_reads_the_cache_and_matches_the_conversion(tmp_path, cache, monkeypatch):
    from transformers import AutoTokenizer

    path = write_gguf(tmp_path / "m.gguf")
    converted = _load(path)
    assert len(list(cache.glob("gguf-tokenizers/*/tokenizer.json"))) == 1
    _never_convert(monkeypatch)
    cached = _load(path)
    reference = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    assert cached.core.eos_token_ids == converted.core.eos_token_ids == [2]
    for text in TEXTS:
        want = reference(text)["input_ids"]
        assert cached.core.encode(text) == converted.core.encode(text) == want
        assert cached.hf(text)["input_ids"] == want
    assert (cached.hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
            == reference.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True))


def test_cache_follows_the_metadata_not_the_path(tmp_path, cache, monkeypatch):
    _load(write_gguf(tmp_path / "m.gguf"))
    (tmp_path / "elsewhere").mkdir()
    copy = shutil.copy(tmp_path / "m.gguf", tmp_path / "elsewhere" / "renamed.gguf")
    with monkeypatch.context() as m:
        _never_convert(m)
        _load(copy)
    _load(write_gguf(tmp_path / "other.gguf", name="another model"))
    assert len(list(cache.glob("gguf-tokenizers/*/tokenizer.json"))) == 2


def test_an_unwritable_cache_falls_back_to_a_temporary_folder(tmp_path, monkeypatch, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("FERROLLM_CACHE_ROOT", str(blocker))
    with caplog.at_level(logging.WARNING, logger="ferrollm"):
        tokenizers = _load(write_gguf(tmp_path / "m.gguf"))
    assert "cannot cache the GGUF tokenizer" in caplog.text
    assert tokenizers.core.encode("the cat") == tokenizers.hf("the cat")["input_ids"]
    tokenizers.close()
