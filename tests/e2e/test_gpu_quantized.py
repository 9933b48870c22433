"""Quantized checkpoints on a GPU: the engine's quantized forms on CUDA (the Triton kernels of
`ferrollm.kernels.triton.quant`, inside the decode steps' CUDA graphs) against the same folder on
the CPU's Rust kernels.

The two devices sum in other orders, round activations to 8 bits from slightly different inputs
and (Triton's float32 `tl.dot`) multiply in TF32, so tokens are compared by vLLM's
`check_logprobs_close` rule: equal until the first difference, where each engine's token is in
the other's top 5; before it, each token's log-probability within the format's tolerance.

Needs a CUDA device and compiled Triton kernels: ``TRITON_INTERPRET=0 pytest -m gpu``.
"""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch
import transformers
from helpers.checkpoints import add_tokenizer
from helpers.engine_driver import TINY
from helpers.logprobs_close import check_logprobs_close, top_logprobs
from helpers.quant_checkpoints import write_awq, write_compressed_tensors, write_fp8, write_gptq

from ferrollm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="needs a CUDA device and TRITON_INTERPRET=0"),
]

PROMPT_LENS = [3, 9, 17, 30]
MAX_TOKENS = 12
# Log-probability tolerances where the tokens agree. Weight-only formats: float32 sums in
# another order (~1e-5). int8 activations: an input within rounding of a rounding tie lands on
# either side, and a crossed int8 step moved a logit by up to 0.083 between two CPU computations
# (tests/models/test_quantized_formats.py). e4m3 activations keep 3 mantissa bits: a crossed
# step moves this tiny model's log-probabilities by up to ~0.6 (quantized against float32,
# measured on the CPU), so only the token rule holds there.
WEIGHT_ONLY, INT8_ACT, FP8_ACT = 0.02, 0.25, None

# name -> (writer, engine keyword arguments, tolerance)
CHECKPOINTS = {
    "ct-w8a8": (lambda m, f: write_compressed_tensors(m, "W8A8", f), {}, INT8_ACT),
    "ct-w4a16": (lambda m, f: write_compressed_tensors(m, "W4A16", f, group_size=32), {}, WEIGHT_ONLY),
    "ct-w4a16-asym": (lambda m, f: write_compressed_tensors(m, "W4A16_ASYM", f, group_size=32), {}, WEIGHT_ONLY),
    "ct-w8a16": (lambda m, f: write_compressed_tensors(m, "W8A16", f, group_size=32), {}, WEIGHT_ONLY),
    "ct-fp8": (lambda m, f: write_compressed_tensors(m, "FP8", f), {}, FP8_ACT),
    "ct-fp8-dynamic": (lambda m, f: write_compressed_tensors(m, "FP8_DYNAMIC", f), {}, FP8_ACT),
    "gptq-4-act-order": (lambda m, f: write_gptq(m, f, bits=4, group_size=32, desc_act=True), {}, WEIGHT_ONLY),
    "gptq-8": (lambda m, f: write_gptq(m, f, bits=8, group_size=-1), {}, WEIGHT_ONLY),
    "awq": (lambda m, f: write_awq(m, f, group_size=32), {}, WEIGHT_ONLY),
    "fp8-static": (lambda m, f: write_fp8(m, f, static=True), {}, FP8_ACT),
    "dynamic-fp8": (lambda m, f: m.save_pretrained(f), {"quantization": "fp8"}, FP8_ACT),
    "dynamic-int8": (lambda m, f: m.save_pretrained(f), {"quantization": "int8"}, INT8_ACT),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_dir):
    made = {}

    def get(name: str):
        if name not in made:
            torch.manual_seed(0)
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()
            folder = tmp_path_factory.mktemp(name)
            CHECKPOINTS[name][0](model, folder)
            add_tokenizer(folder, tokenizer_dir)
            made[name] = folder
        return made[name]

    return get


def prompts() -> list[dict]:
    g = torch.Generator().manual_seed(11)
    return [{"prompt_token_ids": torch.randint(3, 384, (k,), generator=g).tolist()} for k in PROMPT_LENS]


def generate(folder, **kw):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    with LLM(model=str(folder), max_num_seqs=4, max_model_len=128, **kw) as llm:
        outs = llm.generate(prompts(), params, use_tqdm=False)
        runner = llm.llm_engine.generation_runner
        graphs = runner.cuda_graphs
        info = {"sizes": sorted(graphs.graphs) if graphs else [], "replays": graphs.num_replays if graphs else 0}
    return [o.outputs[0] for o in outs], info


def assert_logprobs_close(ours, theirs, tol: float | None) -> int:
    """`check_logprobs_close` over each request's completion; returns how many tokens were equal."""
    return sum(check_logprobs_close((a.token_ids, top_logprobs(a)), (b.token_ids, top_logprobs(b)),
                                    f"prompt {i}", tol)
               for i, (a, b) in enumerate(zip(ours, theirs, strict=True)))


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_quantized_checkpoint_on_the_gpu_matches_the_cpu(folders, name, caplog):
    _, engine_kw, tol = CHECKPOINTS[name]
    cpu, _ = generate(folders(name), device="cpu", dtype="float32", **engine_kw)
    with caplog.at_level(logging.INFO, logger="ferrollm"):
        gpu, info = generate(folders(name), device="cuda", dtype="float32", **engine_kw)
    assert assert_logprobs_close(gpu, cpu, tol) >= len(PROMPT_LENS) * 2
    # The quantized products run inside the captured decode graphs.
    assert info["sizes"] == [1, 2, 4] and info["replays"] >= MAX_TOKENS - 2
    assert re.search(r"quantized linear weights: [\d.]+ MiB", caplog.text), caplog.text


@pytest.mark.parametrize("name", ["ct-w4a16", "ct-w8a8", "ct-fp8", "gptq-4-act-order"])
def test_bf16_activations_on_the_gpu_stay_close_to_float32(folders, name):
    """bf16 rounding moves this tiny model's log-probabilities by up to 0.05 unquantized and 0.47
    under fp8 activations (CPU, measured): the token rule alone."""
    folder, engine_kw = folders(name), CHECKPOINTS[name][1]
    fp32, _ = generate(folder, device="cuda", dtype="float32", **engine_kw)
    bf16, _ = generate(folder, device="cuda", dtype="bfloat16", **engine_kw)
    assert assert_logprobs_close(bf16, fp32, None) >= len(PROMPT_LENS)


@pytest.mark.parametrize("name", ["ct-w8a8", "dynamic-fp8"])
def test_graphs_give_the_eager_tokens_with_activation_quantization(folders, name):
    folder, engine_kw = folders(name), CHECKPOINTS[name][1]
    graphed, info = generate(folder, device="cuda", dtype="float32", **engine_kw)
    eager, _ = generate(folder, device="cuda", dtype="float32", enforce_eager=True, **engine_kw)
    assert info["replays"] > 0
    assert [o.token_ids for o in graphed] == [o.token_ids for o in eager]
