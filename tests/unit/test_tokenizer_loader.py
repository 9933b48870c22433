"""Loading a model folder's tokenizers for the core and for transformers."""

from __future__ import annotations

import json
import shutil

import pytest

from ferrollm.config.model_source import ModelSource
from ferrollm.engine.tokenizer_loader import load_tokenizers
from ferrollm.exceptions import TokenizerError


def test_padding_and_truncation_in_tokenizer_json_do_not_reach_the_core(tokenizer_dir, tmp_path):
    # sentence-transformers exports often pad (and truncate) every encoding to a fixed length.
    plain_dir, folder = tmp_path / "plain", tmp_path / "padded"
    for d in (plain_dir, folder):
        d.mkdir()
        shutil.copy(tokenizer_dir / "tokenizer.json", d)
        (d / "tokenizer_config.json").write_text(json.dumps(
            {"bos_token": "<s>", "eos_token": "</s>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    config = json.loads((folder / "tokenizer.json").read_text())
    config["padding"] = {"strategy": {"Fixed": 32}, "direction": "Right", "pad_to_multiple_of": None,
                         "pad_id": 0, "pad_type_id": 0, "pad_token": "<unk>"}
    config["truncation"] = {"max_length": 4, "strategy": "LongestFirst", "stride": 0, "direction": "Right"}
    (folder / "tokenizer.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    plain = load_tokenizers(ModelSource(folder=plain_dir), None)
    padded = load_tokenizers(ModelSource(folder=folder), None)
    try:
        text = "Hello world, the quick brown fox jumps over the lazy dog."
        ids = plain.core.encode(text)
        assert len(ids) > 4
        assert padded.core.encode(text) == ids == padded.hf(text)["input_ids"]
        assert padded.core.encode_batch([text, "a"]) == plain.core.encode_batch([text, "a"])
        assert padded.core.eos_token_ids == [2, 7]  # the side files came along
    finally:
        plain.close()
        padded.close()


def test_hf_tokenizer_loads_on_first_use_and_its_errors_name_the_folder(tokenizer_dir, tmp_path):
    # The core reads tokenizer.json itself; transformers is only needed for chat templates and
    # `get_tokenizer()`, so a config transformers cannot use fails there, not at start-up.
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"5": 1}}))
    tokenizers = load_tokenizers(ModelSource(folder=tmp_path), None)
    try:
        assert tokenizers.core.encode("hello world")
        with pytest.raises(TokenizerError, match=f"could not load the tokenizer from {tmp_path}"):
            _ = tokenizers.hf
    finally:
        tokenizers.close()


def test_hf_tokenizer_is_loaded_once(tokenizer_dir, tmp_path):
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path)
    tokenizers = load_tokenizers(ModelSource(folder=tmp_path), None)
    try:
        first = tokenizers.hf
        assert first is tokenizers.hf
        assert first("hello world")["input_ids"] == tokenizers.core.encode("hello world")
    finally:
        tokenizers.close()
