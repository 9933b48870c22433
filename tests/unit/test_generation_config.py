"""The sampling defaults `generate` takes from generation_config.json, as vLLM reads them."""

from __future__ import annotations

import json

import pytest

from ferrollm.config.generation_config import default_sampling_fields
from ferrollm.exceptions import ConfigError


def test_generation_config_fields(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 64, "do_sample": True,
         "eos_token_id": [2, 7], "min_p": None}))
    assert default_sampling_fields("auto", tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_tokens": 64}
    assert default_sampling_fields("vllm", tmp_path) == {}
    assert default_sampling_fields("vllm", tmp_path, {"temperature": 0.0}) == {"temperature": 0.0}
    assert default_sampling_fields("auto", tmp_path / "nowhere") == {}
    assert default_sampling_fields(str(tmp_path), tmp_path / "nowhere")["top_k"] == 20
    with pytest.raises(ConfigError, match="`generation_config` must be 'auto', 'vllm' or an existing folder"):
        default_sampling_fields(str(tmp_path / "missing"), tmp_path)
