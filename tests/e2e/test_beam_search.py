"""`LLM.beam_search` against transformers' beam search (`num_beams`, `do_sample=False`) on a
tiny checkpoint: the same sequences, best first, with the cumulative logprobs transformers'
forward pass gives them.

The comparison ignores EOS and uses length_penalty=0, where both rank beams by cumulative
logprob alone. Otherwise the two differ by design: vLLM (and ferrollm, which follows it) divides
by the length counting the prompt and not a final EOS token, even with ignore_eos, while
transformers counts generated tokens only and treats no token as EOS when it has none."""

from __future__ import annotations

import pytest
import torch

from ferrollm import LLM
from ferrollm.beam_search import BeamSearchOutput, get_beam_search_score
from ferrollm.sampling_params import BeamSearchParams

PROMPTS = [[1, 17, 42, 99], [1, 250, 31, 7, 8]]


def hf_beams(hf_model, prompt: list[int], width: int, max_tokens: int, length_penalty: float) -> list[list[int]]:
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    out = hf_model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                            max_new_tokens=max_tokens, length_penalty=length_penalty, eos_token_id=None)
    return [row.tolist() for row in out]


def cumulative(hf_model, seq: list[int], prompt_len: int) -> float:
    with torch.no_grad():
        logprobs = hf_model(torch.tensor([seq])).logits[0].float().log_softmax(-1)
    return sum(logprobs[i - 1, seq[i]].item() for i in range(prompt_len, len(seq)))


@pytest.mark.parametrize("width,length_penalty", [(2, 0.0), (4, 0.0)])
def test_beams_match_transformers(tiny_llama, width, length_penalty):
    path, hf_model = tiny_llama
    params = BeamSearchParams(beam_width=width, max_tokens=6, ignore_eos=True, length_penalty=length_penalty)
    with LLM(model=str(path)) as llm:
        outs = llm.beam_search([{"prompt_token_ids": p} for p in PROMPTS], params)
    for prompt, out in zip(PROMPTS, outs):
        assert isinstance(out, BeamSearchOutput) and len(out.sequences) == width
        assert [s.tokens for s in out.sequences] == hf_beams(hf_model, prompt, width, 6, length_penalty)
        for seq in out.sequences:
            assert seq.cum_logprob == pytest.approx(cumulative(hf_model, seq.tokens, len(prompt)), abs=1e-3)
            assert len(seq.logprobs) == 6 and isinstance(seq.text, str)


def test_score_divides_by_length_without_a_final_eos():
    assert get_beam_search_score([1, 2, 3, 4], -8.0, 9, 1.0) == -2.0
    assert get_beam_search_score([1, 2, 3, 9], -6.0, {9}, 1.0) == -2.0
    assert get_beam_search_score([1, 2, 3, 4], -8.0, 9, 0.5) == -4.0
    assert get_beam_search_score([1, 2, 3, 4], -8.0, 9, 0.0) == -8.0


def test_text_prompts_and_eos_finish_beams(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path)) as llm:
        tok = llm.get_tokenizer()
        out = llm.beam_search(["hello world"], BeamSearchParams(beam_width=3, max_tokens=4))[0]
    assert out.sequences[0].tokens[: len(tok("hello world")["input_ids"])] == tok("hello world")["input_ids"]
    scores = [get_beam_search_score(s.tokens, s.cum_logprob, 2) for s in out.sequences]
    assert scores == sorted(scores, reverse=True)


def test_beam_width_is_limited_by_max_logprobs(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path)) as llm:
        with pytest.raises(ValueError, match="greater than max allowed: 20"):
            llm.beam_search(["hi"], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(beam_width=0, max_tokens=2)
