"""Multimodal models on a GPU: the vision encoders, M-RoPE positions, image-span (bidirectional)
attention in the Triton backend and the encoder's start-up profile on CUDA, against the same
requests on the CPU.

float32 on both devices: tokens equal, log-probabilities within 1e-3 (sums in another order; the
tiny models' distributions are near-uniform, so no near ties flip a token here). bfloat16 on the
GPU against float32 on the CPU: vLLM's `check_logprobs_close` token rule.

Needs a CUDA device and compiled Triton kernels: ``TRITON_INTERPRET=0 pytest -m gpu``.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch
from helpers.fuyu_checkpoints import build_fuyu_checkpoint
from helpers.gemma3_checkpoints import build_gemma3_checkpoint
from helpers.internvl_checkpoints import build_internvl_checkpoint
from helpers.logprobs_close import check_logprobs_close, top_logprobs
from helpers.vl_checkpoints import build_vl_checkpoint, random_image

from ferrollm import LLM, SamplingParams

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="needs a CUDA device and TRITON_INTERPRET=0"),
]

MAX_TOKENS = 8
# model -> (builder, the prompt's image placeholder, images per prompt allowed)
MODELS = {
    "qwen2_vl": (lambda f, t: build_vl_checkpoint("qwen2_vl", f, t), "<|vision_start|><|image_pad|><|vision_end|>", 2),
    "qwen2_5_vl": (lambda f, t: build_vl_checkpoint("qwen2_5_vl", f, t), "<|vision_start|><|image_pad|><|vision_end|>", 2),
    "gemma3": (build_gemma3_checkpoint, "<start_of_image>", 2),
    "internvl": (build_internvl_checkpoint, "<IMG_CONTEXT>", 2),
    "fuyu": (build_fuyu_checkpoint, "", 1),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory, tokenizer_dir):
    made = {}

    def get(name: str):
        if name not in made:
            folder = tmp_path_factory.mktemp(name)
            MODELS[name][0](folder, tokenizer_dir)
            made[name] = folder
        return made[name]

    return get


def requests(name: str) -> list:
    _, image, per_prompt = MODELS[name]
    small, wide = random_image(0, 60, 90), random_image(1, 120, 200)
    two = ({"prompt": f"two {image} and {image} compared", "multi_modal_data": {"image": [wide, small]}}
           if per_prompt > 1 else {"prompt": f"{image}a wide one", "multi_modal_data": {"image": wide}})
    return [{"prompt": f"describe {image} now", "multi_modal_data": {"image": small}}, two,
            "plain text request without images"]


def generate(name, folder, **kw):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    with LLM(str(folder), max_model_len=512, max_num_seqs=4, **kw) as llm:
        return [o.outputs[0] for o in llm.generate(requests(name), params, use_tqdm=False)]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_images_on_the_gpu_match_the_cpu(folders, name, caplog):
    cpu = generate(name, folders(name), device="cpu", dtype="float32")
    with caplog.at_level(logging.INFO, logger="ferrollm"):
        gpu = generate(name, folders(name), device="cuda", dtype="float32")
    if name != "fuyu":  # Fuyu's patches go through one linear layer, not an encoder
        assert "the peak includes the vision encoder on" in caplog.text
    for i, (g, c) in enumerate(zip(gpu, cpu, strict=True)):
        assert list(g.token_ids) == list(c.token_ids), f"request {i}"
        for j, t in enumerate(c.token_ids):
            assert abs(g.logprobs[j][t].logprob - c.logprobs[j][t].logprob) < 1e-3, (i, j)


@pytest.mark.parametrize("name", ["qwen2_vl", "gemma3"])
def test_bf16_images_on_the_gpu_keep_the_float32_tokens_until_a_near_tie(folders, name):
    cpu = generate(name, folders(name), device="cpu", dtype="float32")
    gpu = generate(name, folders(name), device="cuda", dtype="bfloat16")
    equal = sum(check_logprobs_close((g.token_ids, top_logprobs(g)), (c.token_ids, top_logprobs(c)), f"request {i}")
                for i, (g, c) in enumerate(zip(gpu, cpu, strict=True)))
    assert equal >= len(cpu)
