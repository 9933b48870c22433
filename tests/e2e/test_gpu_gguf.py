"""A GGUF file on a GPU: its projections and vocabulary table kept as weight-only integers for the
Triton kernels (`gguf_blocks`), against the same file on the CPU's block kernels.

The tiny file holds each of the eight block types, layer 0 mixed as a Q4_K_M file mixes them (q/k
Q4_K beside v Q6_K in one fused layer); its table is Q8_0 and tied to the LM head, or (as in a
Q4_K_M file) Q4_K beside a Q6_K head. The CPU rounds activations to 8 bits per block where the
GPU multiplies float32 activations by the exact weights, so tokens are compared by vLLM's
`check_logprobs_close` rule, with the int8-activation tolerance of e2e/test_gpu_quantized.py.
Measured on the CPU, with the Triton forms run by the interpreter in place of the GPU's: the
tokens of the dequantized weights, and log-probabilities within 0.075 of the block kernels'
while the tokens agreed (30 of 48 tokens; two prompts part at near ties).

Needs a CUDA device and compiled Triton kernels: ``TRITON_INTERPRET=0 pytest -m gpu``.
"""

from __future__ import annotations

import logging
import os
import re

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers.gguf_files import tiny_model_tensors, write_gguf
from helpers.logprobs_close import check_logprobs_close, top_logprobs

from ferrollm import LLM, SamplingParams
from ferrollm.model_executor.layers.quantization.forms import QuantizedLinear

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="needs a CUDA device and TRITON_INTERPRET=0"),
]

TYPES = {"blk.0.attn_q.weight": Q.Q4_K, "blk.0.attn_k.weight": Q.Q4_K, "blk.0.attn_v.weight": Q.Q6_K,
         "blk.0.attn_output.weight": Q.Q5_K, "blk.0.ffn_gate.weight": Q.Q4_K, "blk.0.ffn_up.weight": Q.Q4_K,
         "blk.0.ffn_down.weight": Q.Q6_K, "blk.1.attn_q.weight": Q.Q4_0, "blk.1.attn_k.weight": Q.Q4_1,
         "blk.1.attn_v.weight": Q.Q5_0, "blk.1.attn_output.weight": Q.Q5_1, "blk.1.ffn_gate.weight": Q.Q8_0,
         "blk.1.ffn_up.weight": Q.Q5_1, "blk.1.ffn_down.weight": Q.Q4_0}
PROMPT_LENS = [3, 9, 17, 30]
MAX_TOKENS = 12
TOLERANCE = 0.25


TABLES = {"tied": {}, "untied": {"token_embd.weight": Q.Q4_K, "output.weight": Q.Q6_K}}


@pytest.fixture(scope="module", params=sorted(TABLES))
def gguf_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / f"tiny-mixed-{request.param}.gguf"
    return write_gguf(path, tensors=tiny_model_tensors({**TYPES, **TABLES[request.param]}), hidden=256, ffn=512)


def generate(path, device: str):
    g = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(3, 269, (k,), generator=g).tolist()} for k in PROMPT_LENS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    with LLM(model=str(path), device=device, dtype="float32", max_num_seqs=4, max_model_len=128) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
        runner = llm.llm_engine.generation_runner
        replays = runner.cuda_graphs.num_replays if runner.cuda_graphs else 0
        if device == "cuda":  # the head multiplies by the table's integers, the embedding reads them
            model = runner.model
            assert isinstance(model.lm_head._cpu, QuantizedLinear) and model.lm_head._cpu.packed.is_cuda
            assert isinstance(model.model.embed_tokens.weight.table_form, QuantizedLinear)
            assert model.model.embed_tokens.weight.numel() == 0
    return [o.outputs[0] for o in outs], replays


def test_a_gguf_file_on_the_gpu_matches_the_cpu(gguf_file, caplog):
    cpu, _ = generate(gguf_file, "cpu")
    with caplog.at_level(logging.INFO, logger="ferrollm"):
        gpu, replays = generate(gguf_file, "cuda")
    equal = sum(check_logprobs_close((a.token_ids, top_logprobs(a)), (b.token_ids, top_logprobs(b)),
                                     f"prompt {i}", TOLERANCE)
                for i, (a, b) in enumerate(zip(gpu, cpu, strict=True)))
    assert equal >= len(PROMPT_LENS) * 2
    assert replays >= MAX_TOKENS - 2  # the integer products run inside the captured decode graphs
    assert "GGUF projections kept quantized on cuda" in caplog.text, caplog.text
    assert re.search(r"GGUF projections: [\d.]+ MiB of the file's blocks held as [\d.]+ MiB", caplog.text), caplog.text
