"""Tiny random HF checkpoints, and a loop that drives a ferrollm model with the Rust core's steps.

The loop is the model runner in miniature: schedule, wrap the arrays, forward, logits at
``logits_indices``, greedy argmax, update. It records every sampled row's logits so tests can hold
them against transformers' forward pass over the same sequence.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import transformers

import ferrollm
from ferrollm.attention.backend import AttentionMetadata, allocate_kv_cache
from ferrollm.model_executor.loader import get_model, iterate_safetensors

TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=384,
    max_position_embeddings=256,
    # Wider than HF's default 0.02 so logits are spread out and greedy picks have clear margins.
    initializer_range=0.2,
)

CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**TINY),
    "llama3_rope": lambda: transformers.LlamaConfig(
        **TINY, attention_bias=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 32}),
    "llama_linear_rope": lambda: transformers.LlamaConfig(
        **TINY, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
    "qwen2_sliding": lambda: transformers.Qwen2Config(
        **TINY, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    # Every layer slides.
    "mistral_sliding": lambda: transformers.MistralConfig(**TINY, sliding_window=7),
    # head_dim 32 != hidden / heads; layer 1 slides.
    "qwen3": lambda: transformers.Qwen3Config(
        **TINY, head_dim=32, use_sliding_window=True, sliding_window=6, max_window_layers=1),
    "gemma": lambda: transformers.GemmaConfig(**TINY, head_dim=32),
    # Layers slide, attend globally, slide; caps small enough to bite on these logits.
    "gemma2": lambda: transformers.Gemma2Config(
        **{**TINY, "num_hidden_layers": 3}, head_dim=16, sliding_window=6, query_pre_attn_scalar=24,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **{**TINY, "num_hidden_layers": 3}, head_dim=32, sliding_window=6, query_pre_attn_scalar=32,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}),
    # Half the head rotated; every layer slides. Phi3's default pad/eos ids exceed the tiny vocab.
    "phi3": lambda: transformers.Phi3Config(
        **TINY, sliding_window=8, pad_token_id=0, eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    "granite": lambda: transformers.GraniteConfig(
        **TINY, embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1,
        logits_scaling=2.0),
}

# Multi-head-only architectures (GPT-2, OPT, GPT-NeoX) take the same sizes without KV grouping.
TINY_MHA = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
# Four experts, two per token, experts smaller than the dense MLP (as in real MoE checkpoints).
TINY_MOE = dict(TINY, intermediate_size=32, num_experts_per_tok=2)
EAGER = dict(attn_implementation="eager")

# Learned-position, LayerNorm and mixture-of-experts architectures, kept apart from CONFIGS so
# test_tiny_models.py (which runs every CONFIGS entry) and test_archs_b.py (which runs these
# through the same scenarios) do not both drive them.
MORE_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(
        n_embd=64, n_inner=128, n_layer=2, n_head=4, vocab_size=384, n_positions=256,
        initializer_range=0.2, bos_token_id=1, eos_token_id=2, **EAGER),
    # facebook/opt-125m's layout: pre-LN, embeddings in the hidden size, final norm.
    "opt": lambda: transformers.OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=384,
        max_position_embeddings=256, init_std=0.2, **EAGER),
    # facebook/opt-350m's layout: post-LN, no final norm, 32-wide embeddings projected in and out.
    "opt_post_ln_projected": lambda: transformers.OPTConfig(
        hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4, vocab_size=384,
        max_position_embeddings=256, init_std=0.2, do_layer_norm_before=False,
        word_embed_proj_dim=32, **EAGER),
    # Pythia's layout: parallel residual, a quarter of each head rotated (older `rotary_pct` name).
    "gpt_neox": lambda: transformers.GPTNeoXConfig(**TINY_MHA, rotary_pct=0.25, **EAGER),
    "gpt_neox_sequential": lambda: transformers.GPTNeoXConfig(
        **TINY_MHA, use_parallel_residual=False, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
        **EAGER),
    # adept/persimmon-8b's layout: q/k LayerNorm, half of each head rotated, relu2 MLP.
    "persimmon": lambda: transformers.PersimmonConfig(**TINY_MHA, qk_layernorm=True, **EAGER),
    "mixtral": lambda: transformers.MixtralConfig(**TINY_MOE, num_local_experts=4, **EAGER),
    # Layer 0 routed (with the gated shared expert), layer 1 dense; top-k weights not renormalised.
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **dict(TINY_MOE, intermediate_size=96), num_experts=4, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False, **EAGER),
}

# The scheduling situations every architecture is driven through, by name.
SCENARIOS = {
    # Everything in one batch, no cache reuse.
    "batched": dict(prompts=dict(), engine=dict(enable_prefix_caching=False)),
    # Seven requests find the first one's two full blocks of shared prefix in the cache.
    "prefix_caching": dict(prompts=dict(prefix=list(range(3, 35))),
                           engine=dict(enable_prefix_caching=True, first_alone=True)),
    # Prompts longer than the token budget are split into chunks that start mid-prompt.
    "chunked_prefill": dict(prompts=dict(), engine=dict(max_num_batched_tokens=16, max_num_seqs=8)),
    # 23 usable blocks of 4 tokens cannot hold eight requests growing to 48 tokens.
    "preemption": dict(prompts=dict(), engine=dict(block_size=4, num_blocks=24, max_model_len=64,
                                                   max_num_seqs=8)),
}


def build_checkpoint(name: str, folder: Path, seed: int = 0,
                     perturb_norms: bool = False) -> transformers.PreTrainedModel:
    """Saves a random tiny model of kind ``name`` (see ``CONFIGS``, ``MORE_CONFIGS``) to ``folder``.

    Args:
        perturb_norms: add noise to the norm weights, which transformers initialises to a
            constant, so that swapped or mis-offset norms show in the outputs.

    Returns:
        The transformers model, float32, eager attention, eval mode, never stopping at EOS.
    """
    torch.manual_seed(seed)
    config = (CONFIGS.get(name) or MORE_CONFIGS[name])()
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    if perturb_norms:
        with torch.no_grad():
            for param_name, param in model.named_parameters():
                if "norm" in param_name:
                    param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)  # safetensors
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def load_ferrollm_model(folder: Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> torch.nn.Module:
    """Loads the checkpoint in ``folder`` with ferrollm's loader, built on ``device`` (a CPU model
    keeps its linear weights in CPU forms, so it cannot be moved to a GPU afterwards)."""
    config = transformers.AutoConfig.from_pretrained(folder)
    return get_model(config, dtype, iterate_safetensors(folder), device=device)


@dataclass
class EngineRun:
    """What :func:`run_engine` saw."""

    tokens: dict[str, list[int]]
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    num_steps: int = 0
    num_chunked_steps: int = 0  # steps with a prefill chunk that did not sample
    stats: dict = field(default_factory=dict)


def make_prompts(num: int, seed: int, vocab: int, min_len: int = 3, max_len: int = 40,
                 prefix: list[int] | None = None) -> list[list[int]]:
    """``num`` random prompts of different lengths, optionally after a shared ``prefix``."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(min_len, max_len, num).astype(int)
    return [list(prefix or []) + rng.integers(3, vocab, n).tolist() for n in lengths]


@torch.no_grad()
def run_engine(model, prompts: list[list[int]], max_tokens: int, *, block_size: int = 16,
               num_blocks: int = 128, first_alone: bool = False, **engine_kwargs) -> EngineRun:
    """Generates greedily for ``prompts`` through ``ferrollm.EngineCore``.

    Args:
        model: a ferrollm model.
        prompts: token ids; request ``i`` is named ``str(i)``.
        max_tokens: tokens to generate per request (EOS ignored).
        block_size, num_blocks, engine_kwargs: EngineCore options.
        first_alone: schedule one step of request 0 before adding the others, so its full
            blocks are cached by the time they arrive (prefix-caching tests).

    Returns:
        The tokens, per-token logits and step counts.
    """
    engine_kwargs.setdefault("max_model_len", 128)
    core = ferrollm.EngineCore(block_size=block_size, num_blocks=num_blocks, **engine_kwargs)
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    kv_caches = allocate_kv_cache(num_layers, num_blocks, block_size, num_kv_heads, head_dim, model.dtype)
    params = ferrollm.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [str(i) for i in range(len(prompts))]
    run = EngineRun(tokens={}, logits={i: [] for i in ids})
    names: dict[int, str] = {}
    pending = list(zip(ids, prompts))
    if first_alone:
        core.add_requests([ids[0]], [prompts[0]], [params])
        pending = pending[1:]
        _step(core, model, kv_caches, block_size, names, run)
    core.add_requests([i for i, _ in pending], [p for _, p in pending], [params] * len(pending))
    while core.has_unfinished_requests():
        _step(core, model, kv_caches, block_size, names, run)
    run.stats = core.stats()
    return run


def _step(core, model, kv_caches, block_size, names, run: EngineRun) -> None:
    step = core.schedule()
    run.num_steps += 1
    for new in step.scheduled_new_reqs:
        names[new.req_index] = new.request_id
    if len(step) == 0:
        core.update(np.zeros(0, dtype=np.int64))
        return
    meta = AttentionMetadata.from_step(step, block_size)
    hidden = model(torch.from_numpy(step.input_ids), torch.from_numpy(step.positions), kv_caches, meta)
    logits = model.compute_logits(hidden[torch.from_numpy(step.logits_indices)])
    sampled = logits.argmax(dim=-1)
    run.num_chunked_steps += int(not step.needs_sample.all())
    for row, req_index in enumerate(step.req_indices.tolist()):
        if step.needs_sample[row]:
            run.logits[names[req_index]].append(logits[row])
    for out in core.update(sampled.numpy()):
        run.tokens[out.request_id] = list(out.token_ids)


@torch.no_grad()
def hf_greedy(hf_model, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy continuation and its logits for each generated token.

    Returns:
        ``(tokens, logits [max_tokens, vocab])`` where row ``k`` is the forward pass's logits at
        the position that predicts token ``k``.
    """
    input_ids = torch.tensor([prompt])
    # The caller has set generation_config.eos_token_id = None, so no request stops early.
    out = hf_model.generate(input_ids, do_sample=False, max_new_tokens=max_tokens)
    tokens = out[0, len(prompt):].tolist()
    assert len(tokens) == max_tokens
    logits = hf_model(out).logits[0, len(prompt) - 1 : -1].float()
    return tokens, logits


def check_scenario(model, scenario: str, reference: Callable[[list[int]], tuple[list[int], torch.Tensor]],
                   max_tokens: int, label: str = "") -> None:
    """Runs `SCENARIOS[scenario]`'s eight prompts through the core and `model`, and checks them.

    Each request's greedy tokens must equal `reference(prompt)`'s, its per-step logits must be
    within 1e-4 and its top-5 log-probabilities within 1e-3; and the scenario must really have
    happened (prefix hits, chunked steps, preemptions).
    """
    spec = SCENARIOS[scenario]
    prompts = make_prompts(8, seed=1, vocab=TINY["vocab_size"], **spec["prompts"])
    run = run_engine(model, prompts, max_tokens, **spec["engine"])
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logits = reference(prompt)
        assert run.tokens[str(i)] == ref_tokens, f"{label}: request {i} (prompt length {len(prompt)})"
        logits = torch.stack(run.logits[str(i)])
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
        ref_logprobs, top5 = ref_logits.log_softmax(-1), ref_logits.topk(5).indices
        torch.testing.assert_close(logits.log_softmax(-1).gather(-1, top5),
                                   ref_logprobs.gather(-1, top5), atol=1e-3, rtol=0)
    if scenario == "prefix_caching":
        assert run.stats["prefix_cache_hit_tokens"] >= 7 * 32
    if scenario == "chunked_prefill":
        assert run.num_chunked_steps > 0
    if scenario == "preemption":
        assert run.stats["num_preemptions"] > 0
