"""Mistral, Qwen3, Gemma 1/2/3, Phi-3 and Granite: tiny random checkpoints driven by the Rust
core's steps reproduce transformers (greedy tokens and per-step logits) under batching, prefix
hits and chunked prefill, with prompts longer than the sliding windows; plus the options each
architecture refuses and the layers they added."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers
from helpers.engine_driver import SCENARIOS, TINY, build_checkpoint, check_scenario, hf_greedy, load_ferrollm_model
from transformers.activations import ACT2FN
from transformers.models.gemma import modeling_gemma

from ferrollm.exceptions import UnsupportedModelError
from ferrollm.model_executor.layers.activation import get_act_and_mul
from ferrollm.model_executor.layers.norm import GemmaRMSNorm
from ferrollm.model_executor.models.gemma2 import Gemma2ForCausalLM
from ferrollm.model_executor.models.gemma3 import gemma3_rope_parameters
from ferrollm.model_executor.models.phi3 import Phi3ForCausalLM
from ferrollm.model_executor.models.utils import layer_sliding_window

torch.set_num_threads(1)

MAX_TOKENS = 8

# CONFIGS kind -> (architecture, sliding_window_spec(): the window iff every layer slides).
ARCHS = {
    "mistral_sliding": ("MistralForCausalLM", 7),
    "qwen3": ("Qwen3ForCausalLM", None),
    "gemma": ("GemmaForCausalLM", None),
    "gemma2": ("Gemma2ForCausalLM", None),
    "gemma3": ("Gemma3ForCausalLM", None),
    "phi3": ("Phi3ForCausalLM", 8),
    "granite": ("GraniteForCausalLM", None),
}

# Prompt lengths 3..40 straddle the windows (6-8); preemption is covered by the Llama-family file.
SCENARIOS = {k: v for k, v in SCENARIOS.items() if k != "preemption"}


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf_model = build_checkpoint(request.param, folder, perturb_norms=True)
    references: dict[tuple[int, ...], tuple[list[int], torch.Tensor]] = {}

    def reference(prompt: list[int]):
        # Scenarios share prompts; transformers' generate is the slow half of each test.
        if tuple(prompt) not in references:
            references[tuple(prompt)] = hf_greedy(hf_model, prompt, MAX_TOKENS)
        return references[tuple(prompt)]

    return request.param, load_ferrollm_model(folder), reference


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_tokens_and_logits_match_transformers(checkpoint, scenario):
    kind, model, reference = checkpoint
    check_scenario(model, scenario, reference, MAX_TOKENS, label=kind)


def test_architecture_and_sliding_window_spec(checkpoint):
    kind, model, _ = checkpoint
    arch, window = ARCHS[kind]
    assert type(model).__name__ == arch
    assert model.sliding_window_spec() == window


@pytest.mark.parametrize("checkpoint", ["gemma3"], indirect=True)
def test_gemma3_layers_use_their_own_rope_base(checkpoint):
    _, model, _ = checkpoint
    sliding, full, sliding_again = (layer.self_attn for layer in model.model.layers)
    assert sliding.attn.sliding_window == 6 and full.attn.sliding_window is None
    # Layers with the same settings share one table; the global one differs.
    assert sliding.rotary_emb is sliding_again.rotary_emb
    assert not torch.equal(sliding.rotary_emb.cos_sin_cache, full.rotary_emb.cos_sin_cache)


def test_gemma3_rope_parameters_from_either_config_layout():
    old = SimpleNamespace(rope_theta=1e6, rope_local_base_freq=1e4, rope_parameters=None,
                          rope_scaling={"rope_type": "linear", "factor": 8.0},
                          max_position_embeddings=1024)
    assert gemma3_rope_parameters(old, sliding=True) == {"rope_type": "default", "rope_theta": 1e4}
    glob = gemma3_rope_parameters(old, sliding=False)
    assert (glob["rope_type"], glob["rope_theta"], glob["factor"]) == ("linear", 1e6, 8.0)

    new = transformers.Gemma3TextConfig(rope_theta=5e5, rope_local_base_freq=2e3)
    assert gemma3_rope_parameters(new, sliding=True)["rope_theta"] == 2e3
    assert gemma3_rope_parameters(new, sliding=False)["rope_theta"] == 5e5


def test_phi3_long_context_rope_is_refused():
    config = transformers.Phi3Config(
        **TINY, pad_token_id=0, eos_token_id=2,
        rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 8,
                         "long_factor": [2.0] * 8, "original_max_position_embeddings": 64})
    with pytest.raises(UnsupportedModelError, match="longrope"):
        Phi3ForCausalLM(config)


def test_bidirectional_gemma_is_refused():
    config = transformers.Gemma2Config(**TINY, head_dim=16, use_bidirectional_attention=True)
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention"):
        Gemma2ForCausalLM(config)


def test_unknown_layer_type_and_activation_are_refused():
    config = SimpleNamespace(layer_types=["chunked_attention"], sliding_window=4)
    with pytest.raises(UnsupportedModelError, match="chunked_attention"):
        layer_sliding_window(config, 0, False)
    with pytest.raises(UnsupportedModelError, match="relu2"):
        get_act_and_mul("relu2")


@pytest.mark.parametrize("name", ["silu", "gelu", "gelu_pytorch_tanh", "gelu_new"])
def test_gated_activation_matches_transformers(name):
    gate, up = torch.randn(5, 16), torch.randn(5, 16)
    out = get_act_and_mul(name)(torch.cat([gate, up], dim=-1))
    torch.testing.assert_close(out, ACT2FN[name](gate) * up)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemma_rms_norm_matches_transformers_and_fuses_the_residual(dtype):
    norm = GemmaRMSNorm(16, eps=1e-6, params_dtype=dtype)
    norm.weight.copy_(torch.randn(16))
    hf_norm = modeling_gemma.GemmaRMSNorm(16, eps=1e-6).to(dtype)
    hf_norm.weight.data.copy_(norm.weight)
    x, residual = torch.randn(4, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype)
    out, new_residual = norm(x, residual)
    assert torch.equal(new_residual, x + residual)
    # On the CPU the norm is the Rust kernel, which sums the squares in its own order.
    torch.testing.assert_close(out, hf_norm(x + residual))
