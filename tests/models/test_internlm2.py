"""InternLM2 (remote code on the hub, no transformers copy): a tiny random transformers Llama with
q/k/v/o biases, written under InternLM2's names and config.json (``attention.wqkv`` grouped per KV
head, ``bias`` true), must generate through `LLM` what the Llama generates in transformers, on
one rank and on two."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers.checkpoints import add_tokenizer
from helpers.engine_driver import TINY, hf_greedy, make_prompts
from helpers.internlm2_checkpoints import fuse_wqkv, write_as_internlm2

from ferrollm import LLM, SamplingParams
from ferrollm.exceptions import ConfigError
from ferrollm.model_executor.models.internlm2 import split_wqkv

torch.set_num_threads(2)

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
PROMPTS = make_prompts(3, seed=5, vocab=TINY["vocab_size"], max_len=30)


@pytest.fixture(scope="module")
def internlm2(tmp_path_factory, tokenizer_dir):
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY, attention_bias=True)).eval()
    with torch.no_grad():  # transformers starts biases and norms at constants: random, so a misplaced one shows
        for name, param in llama.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    llama.generation_config.eos_token_id = None
    llama.generation_config.pad_token_id = 0
    folder = write_as_internlm2(llama, tmp_path_factory.mktemp("internlm2"))
    add_tokenizer(folder, tokenizer_dir)
    return folder, llama


def _check_against_llama(llm: LLM, llama) -> None:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        want, logits = hf_greedy(llama, prompt, MAX_TOKENS)
        got = out.outputs[0]
        assert list(got.token_ids) == want
        ref = torch.log_softmax(logits, -1)
        for step, (token, lp) in enumerate(zip(want, got.logprobs)):
            assert abs(lp[token].logprob - ref[step, token].item()) < 1e-4, step


def test_wqkv_regroups_to_q_k_and_v():
    config = transformers.LlamaConfig(**TINY)
    q, k, v = torch.randn(64, 8), torch.randn(32, 8), torch.randn(32, 8)
    fused = fuse_wqkv(q, k, v, num_heads=4, num_kv_heads=2)
    # KV group 0 is rows [q0, q1, k0, v0] (16 rows each): its key follows its two query heads.
    assert torch.equal(fused[32:48], k[:16]) and torch.equal(fused[48:64], v[:16])
    assert all(torch.equal(a, b) for a, b in zip(split_wqkv(fused, config), (q, k, v)))


def test_greedy_tokens_and_logprobs_match_the_llama(internlm2):
    folder, llama = internlm2
    with LLM(str(folder), max_model_len=128) as llm:
        model = llm.llm_engine.generation_runner.model
        assert type(model).__name__ == "InternLM2ForCausalLM"
        _check_against_llama(llm, llama)


def test_two_ranks_match_the_llama(internlm2):
    folder, llama = internlm2
    with LLM(str(folder), max_model_len=128, tensor_parallel_size=2) as llm:
        _check_against_llama(llm, llama)


def test_unsupported_positions_are_a_config_error(internlm2, tmp_path):
    import shutil

    folder, _ = internlm2
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_pos_id_version": "v2pe"}))
    with pytest.raises(ConfigError, match=r"rope_pos_id_version.*Given: 'v2pe'"):
        LLM(str(tmp_path), max_model_len=128)
