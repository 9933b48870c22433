"""`kv_cache_dtype` end to end on the CPU: an fp8 cache takes half of bf16's bytes per token (the
start-up log says so), and the prompt and sampled tokens' logprobs stay within a stated tolerance
of the same engine with a float32 cache."""

from __future__ import annotations

import logging
import re
import shutil

import pytest
import torch
from e2e.test_llm_generate import greedy, prompts_for

from ferrollm import LLM
from ferrollm import exceptions as exc
from ferrollm.attention.layer import Attention

# |logprob difference| against the fp32 cache allowed on the tiny random checkpoint, in nats:
# (mean over prompt tokens, mean over sampled tokens, largest anywhere). e4m3 keeps 3 mantissa
# bits (relative error <= 1/16 per element), e5m2 2 bits (1/8); this checkpoint's keys reach ~6
# and its logits spread over ~10 nats, so it is far more sensitive than a trained model (measured
# here: e4m3 0.11 / 0.10 / 1.06, e5m2 0.23 / 0.17 / 0.97; SmolLM2-135M, 4 prompts x 16 tokens:
# e4m3 mean 0.07 / largest 0.49, e5m2 0.08 / 0.71). A wrong scale or a misread block costs
# several nats.
TOLERANCE = {"fp8": (0.2, 0.2, 1.5), "fp8_e5m2": (0.35, 0.3, 1.5)}


def _bytes_per_token(log: str) -> int:
    return int(re.search(r"(\d+) bytes per token", log).group(1))


def test_fp8_cache_takes_half_of_bf16s_bytes_per_token(tiny_llama, caplog):
    path, hf_model = tiny_llama
    c = hf_model.config
    head_dim = c.hidden_size // c.num_attention_heads
    bf16_per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2
    with caplog.at_level(logging.INFO, logger="ferrollm"), LLM(model=str(path), dtype="bfloat16", max_model_len=64,
                                                                kv_cache_dtype="fp8") as llm:
        assert all(t.element_size() == 1 for t in llm.llm_engine.runner.kv_caches)
        assert llm.llm_engine.vllm_config.cache_config.cache_dtype == "fp8"
        out = llm.generate(["hello"], greedy(4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert _bytes_per_token(caplog.text) * 2 == bf16_per_token
    assert "float8_e4m3fn" in caplog.text


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_logprobs_stay_near_the_fp32_caches(tiny_llama, kv_cache_dtype):
    path, hf_model = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in prompts_for(hf_model.config.vocab_size)]
    params = greedy(8, logprobs=0, prompt_logprobs=0)
    runs = {}
    for cache in ("auto", kv_cache_dtype):
        # A small budget, so prompts are prefilled in chunks that read earlier chunks from the cache.
        with LLM(model=str(path), max_model_len=64, max_num_batched_tokens=32, max_num_seqs=8,
                 kv_cache_dtype=cache) as llm:
            runs[cache] = llm.generate(prompts, params, use_tqdm=False)
    prompt_diffs, sampled_diffs = [], []
    for ref, got in zip(runs["auto"], runs[kv_cache_dtype]):
        for i, tok in enumerate(got.prompt_token_ids[1:], start=1):
            prompt_diffs.append(abs(ref.prompt_logprobs[i][tok].logprob - got.prompt_logprobs[i][tok].logprob))
        # The sampled tokens' logprobs, up to the first token where the two runs part.
        for r_tok, g_tok, r_lp, g_lp in zip(ref.outputs[0].token_ids, got.outputs[0].token_ids,
                                             ref.outputs[0].logprobs, got.outputs[0].logprobs):
            if r_tok != g_tok:
                break
            sampled_diffs.append(abs(r_lp[g_tok].logprob - g_lp[g_tok].logprob))
    prompt_mean, sampled_mean = sum(prompt_diffs) / len(prompt_diffs), sum(sampled_diffs) / len(sampled_diffs)
    worst = max(prompt_diffs + sampled_diffs)
    assert len(sampled_diffs) >= 8 and worst > 0.0, "the fp8 cache changed nothing: was it used?"
    bound = TOLERANCE[kv_cache_dtype]
    assert prompt_mean < bound[0] and sampled_mean < bound[1] and worst < bound[2], (prompt_mean, sampled_mean, worst)


def test_fp8_cache_is_refused_on_a_gpu_and_bad_names_are_refused(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(NotImplementedError, match="kv_cache_dtype='fp8'.*CPU only"):
        LLM(model=str(path), device="cuda", kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(model=str(path), kv_cache_dtype="int8")


def test_checkpoint_kv_scales_reach_the_attention_layers(tiny_llama, tmp_path):
    from safetensors.torch import load_file, save_file

    path, hf_model = tiny_llama
    folder = tmp_path / "with-scales"
    shutil.copytree(path, folder)
    (weights_file,) = folder.glob("*.safetensors")
    tensors = load_file(weights_file)
    # vLLM's names: one scale per tensor for keys and values, or the older shared `kv_scale`.
    tensors["model.layers.0.self_attn.k_scale"] = torch.tensor(0.25)
    tensors["model.layers.0.self_attn.v_scale"] = torch.tensor(0.5)
    tensors["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    prompts = [{"prompt_token_ids": p} for p in prompts_for(hf_model.config.vocab_size)[:4]]
    with LLM(model=str(folder), max_model_len=64, kv_cache_dtype="fp8") as llm:
        layers = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, Attention)]
        assert [(a.k_scale, a.v_scale) for a in layers] == [(0.25, 0.5), (2.0, 2.0)]
        outs = llm.generate(prompts, greedy(4), use_tqdm=False)
    with LLM(model=str(path), max_model_len=64, kv_cache_dtype="fp8") as llm:
        unscaled = llm.generate(prompts, greedy(4), use_tqdm=False)
    # The scales change what the cache rounds, not what attention computes.
    assert sum(o.outputs[0].token_ids == u.outputs[0].token_ids for o, u in zip(outs, unscaled)) >= 3
    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(4)
    save_file(tensors, weights_file, metadata={"format": "pt"})
    with pytest.raises(exc.CheckpointError, match="holds 4 scales"):
        LLM(model=str(folder), max_model_len=64, kv_cache_dtype="fp8")
