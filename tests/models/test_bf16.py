"""bf16 on the CPU: a checkpoint saved in bf16 runs in bf16 under ``dtype="auto"``, its linear
layers on ferrollm's bf16 GEMM (native and portable loops), and its greedy tokens and top-5
logprobs follow transformers run in bf16 by vLLM's ``check_logprobs_close`` rule: the tokens are
equal until the first position where they differ, and there each run's token is among the other's
top 5 (a near tie that bf16's rounding may break either way). fp32 parity tests stay in their own
files; this one is bf16's tolerance."""

from __future__ import annotations

import logging

import pytest
import torch
from ferrollm import LLM, SamplingParams
from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.model_executor.layers.cpu_weights import PackedBf16Weight
from helpers.checkpoints import add_tokenizer
from helpers.engine_driver import build_checkpoint, load_ferrollm_model
from helpers.logprobs_close import check_logprobs_close, top_logprobs

torch.set_num_threads(2)

PROMPT_LENS = [3, 9, 17, 30]
MAX_TOKENS = 8
TOP = 5
needs_kernels = pytest.mark.skipif(not cpu_kernels.supports(torch.empty(1)), reason="no OpenMP team to join")


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def bf16_checkpoint(request, tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp(f"bf16-{request.param}")
    hf_model = build_checkpoint(request.param, folder).to(torch.bfloat16)
    hf_model.save_pretrained(folder)  # config.json now says bfloat16
    add_tokenizer(folder, tokenizer_dir)
    return folder, hf_model


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _hf_greedy_top(hf_model, prompt: list[int]) -> tuple[list[int], list[dict[int, float]]]:
    """transformers' greedy tokens, bf16 forward pass at every step, with each step's top 5."""
    seq, tops = list(prompt), []
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            logprobs = torch.log_softmax(hf_model(torch.tensor([seq])).logits[0, -1].float(), dim=-1)
            top = torch.topk(logprobs, TOP)
            tops.append(dict(zip(top.indices.tolist(), top.values.tolist())))
            seq.append(int(top.indices[0]))
    return seq[len(prompt):], tops


@needs_kernels
@pytest.mark.parametrize("gemm", ["native", "portable"])
def test_a_bf16_checkpoint_runs_bf16_close_to_transformers(bf16_checkpoint, gemm, monkeypatch, caplog):
    if gemm == "portable":
        monkeypatch.setenv("FERROLLM_CPU_GEMM", "portable")
    folder, hf_model = bf16_checkpoint
    prompts = _prompts(hf_model.config.vocab_size)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)
    with caplog.at_level(logging.INFO, logger="ferrollm.config.model_config"), LLM(model=str(folder)) as llm:
        assert llm.llm_engine.model_config.dtype == torch.bfloat16  # dtype="auto"
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert "dtype='auto' resolved to bfloat16 on the CPU: the checkpoint is bf16" in caplog.text
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        ours = (c.token_ids, top_logprobs(c))
        check_logprobs_close(ours, _hf_greedy_top(hf_model, prompt), f"prompt of {len(prompt)}")


@needs_kernels
def test_bf16_linear_layers_keep_one_packed_bf16_copy(bf16_checkpoint):
    folder, _ = bf16_checkpoint
    model = load_ferrollm_model(folder, dtype=torch.bfloat16)
    layer = model.model.layers[0]
    for proj in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(proj._cpu, PackedBf16Weight) and proj.weight.is_meta
