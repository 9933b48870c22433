"""GPT-2, OPT, GPT-NeoX, Persimmon, Mixtral and Qwen2-MoE.

Tiny random checkpoints driven by the Rust core's steps reproduce transformers' greedy tokens and
logits, and two gloo ranks reproduce one; the grouped routed-expert path matches a per-token
reference and splits over TP ranks; each model loads the other checkpoint layouts found in the
wild to the same parameters.
"""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
import transformers
from helpers.engine_driver import (
    MORE_CONFIGS,
    SCENARIOS,
    TINY,
    build_checkpoint,
    check_scenario,
    hf_greedy,
    load_ferrollm_model,
    make_prompts,
    run_engine,
)
from helpers.tp_worker import run_rank
from safetensors.torch import save_file

from ferrollm.distributed import init_tensor_model_parallel
from ferrollm.exceptions import UnsupportedModelError
from ferrollm.model_executor.layers.activation import get_act_fn
from ferrollm.model_executor.layers.fused_moe import FusedMoE, fused_moe, select_experts
from ferrollm.model_executor.layers.rotary import rope_parameters
from ferrollm.model_executor.loader import get_model, iterate_safetensors
from ferrollm.model_executor.sharded_state import dense_state_dict

ARCHS = sorted(MORE_CONFIGS)
MAX_TOKENS = 8
VOCAB = TINY["vocab_size"]



@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # A fixture, not an import-time call: other test modules set their own count when collected.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module", params=ARCHS)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    # Persimmon's q/k LayerNorms start as the identity; noise makes a swapped one show.
    hf_model = build_checkpoint(request.param, folder, perturb_norms=request.param == "persimmon")
    return folder, hf_model, load_ferrollm_model(folder)


@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_greedy_tokens_and_logits_match_transformers(checkpoint, scenario):
    folder, hf_model, model = checkpoint
    check_scenario(model, scenario, lambda prompt: hf_greedy(hf_model, prompt, MAX_TOKENS), MAX_TOKENS,
                   label=folder.name)


def test_two_ranks_match_one(tmp_path):
    """Every sharded piece: fused/transposed/regrouped qkv, experts split by intermediate size,
    the shared expert's single reduction, replicated projections and position tables."""
    folders = [tmp_path / arch for arch in ARCHS]
    for arch, folder in zip(ARCHS, folders):
        build_checkpoint(arch, folder)
    prompts = make_prompts(4, seed=3, vocab=VOCAB, max_len=20)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    mp.spawn(run_rank, nprocs=2, join=True,
             args=(2, str(tmp_path / "store"), [str(f) for f in folders], prompts, 6, str(out_dir)))

    for i, folder in enumerate(folders):
        single = run_engine(load_ferrollm_model(folder), prompts, 6)
        sharded = torch.load(out_dir / f"{i}.pt")
        assert sharded["tokens"] == single.tokens, folder.name
        for req, logits in single.logits.items():
            torch.testing.assert_close(torch.stack(sharded["logits"][req]), torch.stack(logits),
                                       atol=1e-4, rtol=0, msg=folder.name)


# ---- the routed-expert path ---------------------------------------------------------------


def per_token_moe(x, w13, w2, router_logits, top_k, renormalize):
    """The definition, one token and one chosen expert at a time."""
    out = torch.zeros_like(x)
    probs = router_logits.softmax(-1)
    for t in range(len(x)):
        weights, experts = probs[t].topk(top_k)
        if renormalize:
            weights = weights / weights.sum()
        for weight, e in zip(weights, experts.tolist()):
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weight * (w2[e] @ (F.silu(gate) * up))
    return out


def random_experts(num_experts=6, hidden=16, intermediate=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * intermediate, hidden, generator=gen) * 0.3
    w2 = torch.randn(num_experts, hidden, intermediate, generator=gen) * 0.3
    return w13, w2


@pytest.mark.parametrize("num_tokens", [0, 1, 37])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_matches_per_token_reference(num_tokens, renormalize):
    w13, w2 = random_experts()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, w13.shape[2], generator=gen)
    router_logits = torch.randn(num_tokens, w13.shape[0], generator=gen) * 2
    weights, ids = select_experts(router_logits, 2, renormalize)
    out = fused_moe(x, w13, w2, weights, ids)
    expected = per_token_moe(x, w13, w2, router_logits, 2, renormalize)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.fixture
def set_tp():
    yield init_tensor_model_parallel
    init_tensor_model_parallel(0, 1)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_fused_moe_ranks_load_slices_whose_partial_sums_add_up(set_tp, tp_size):
    num_experts, hidden, intermediate = 6, 16, 24
    w13, w2 = random_experts(num_experts, hidden, intermediate)
    x = torch.randn(9, hidden)
    router_logits = torch.randn(9, num_experts)
    total = torch.zeros_like(x)
    for rank in range(tp_size):
        set_tp(rank, tp_size)
        layer = FusedMoE(num_experts, 2, hidden, intermediate, renormalize=True, reduce_results=False)
        for e in range(num_experts):
            gate, up = w13[e].chunk(2)
            layer.w13_weight.weight_loader(layer.w13_weight, gate, ("gate", e))
            layer.w13_weight.weight_loader(layer.w13_weight, up, ("up", e))
            layer.w2_weight.weight_loader(layer.w2_weight, w2[e], ("down", e))
        assert layer.w13_weight.shape == (num_experts, 2 * intermediate // tp_size, hidden)
        total += layer(x, router_logits)
    expected = per_token_moe(x, w13, w2, router_logits, 2, True)
    torch.testing.assert_close(total, expected, atol=1e-5, rtol=1e-5)


# ---- checkpoint layouts ---------------------------------------------------------------------


def load_renamed(folder, rename):
    """The checkpoint in ``folder`` with its tensors renamed/extended by ``rename``."""
    config = transformers.AutoConfig.from_pretrained(folder)
    return get_model(config, torch.float32, rename(iterate_safetensors(folder)))


def assert_same_parameters(a, b):
    # The plain weights, whatever CPU form holds them.
    a_params, b_params = dense_state_dict(a), dense_state_dict(b)
    assert a_params.keys() == b_params.keys()
    for name, param in a_params.items():
        assert torch.equal(param, b_params[name]), name


def gpt2_original_release(weights):
    # No `transformer.` prefix, plus the saved causal-mask buffers.
    for name, tensor in weights:
        yield name.removeprefix("transformer."), tensor
        if name.endswith("attn.c_attn.bias"):
            yield name.removeprefix("transformer.").replace("c_attn.bias", "bias"), torch.ones(1, 1, 4, 4)
            yield name.removeprefix("transformer.").replace("c_attn.bias", "masked_bias"), torch.tensor(-1e4)


def opt_original_release(weights):
    for name, tensor in weights:
        yield name.removeprefix("model."), tensor


def pythia_with_buffers(weights):
    for name, tensor in weights:
        yield name, tensor
        if name.endswith("attention.dense.bias"):
            stem = name.removesuffix("dense.bias")
            yield stem + "bias", torch.ones(1, 1, 4, 4, dtype=torch.bool)
            yield stem + "masked_bias", torch.tensor(-1e9)
            yield stem + "rotary_emb.inv_freq", torch.ones(2)


@pytest.mark.parametrize("arch, rename", [("gpt2", gpt2_original_release),
                                          ("opt", opt_original_release),
                                          ("gpt_neox", pythia_with_buffers)])
def test_older_checkpoint_names_load_the_same_parameters(tmp_path, arch, rename):
    build_checkpoint(arch, tmp_path)
    assert_same_parameters(load_ferrollm_model(tmp_path), load_renamed(tmp_path, rename))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_stacked_expert_checkpoints_load_the_same_parameters(tmp_path, arch):
    """transformers 5 holds experts stacked; a checkpoint saved from its state dict keeps them so."""
    hf_model = build_checkpoint(arch, tmp_path / "per_expert")
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    shutil.copy(tmp_path / "per_expert" / "config.json", stacked)
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in state)
    save_file(state, str(stacked / "model.safetensors"))
    assert_same_parameters(load_ferrollm_model(tmp_path / "per_expert"), load_ferrollm_model(stacked))


# ---- layers ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["gelu", "gelu_new", "gelu_fast", "gelu_pytorch_tanh", "quick_gelu",
                                  "relu", "relu2", "silu"])
def test_activations_match_transformers(name):
    from transformers.activations import ACT2FN

    x = torch.linspace(-8, 8, 2001)
    torch.testing.assert_close(get_act_fn(name)(x), ACT2FN[name](x), atol=1e-6, rtol=1e-5)


def test_rope_parameters_read_pre_transformers_5_gpt_neox_names():
    config = SimpleNamespace(rotary_pct=0.25, rotary_emb_base=500, max_position_embeddings=64)
    params = rope_parameters(config)
    assert params["partial_rotary_factor"] == 0.25 and params["rope_theta"] == 500


def test_unsupported_options_are_refused():
    gpt2 = MORE_CONFIGS["gpt2"]()
    gpt2.architectures, gpt2.add_cross_attention = ["GPT2LMHeadModel"], True
    mixtral = MORE_CONFIGS["mixtral"]()
    mixtral.architectures, mixtral.hidden_act = ["MixtralForCausalLM"], "gelu"
    for config, match in ((gpt2, "add_cross_attention"), (mixtral, "hidden_act 'gelu'")):
        with pytest.raises(UnsupportedModelError, match=match):
            get_model(config, torch.float32, [])
    with pytest.raises(UnsupportedModelError, match="'mish'"):
        get_act_fn("mish")
