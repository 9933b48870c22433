"""Loading a model folder's tokenizers for the core and for transformers."""

from __future__ import annotations

import json
import shutil

from ferrollm.config.model_source import ModelSource
from ferrollm.engine.tokenizer_loader import load_tokenizers


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
