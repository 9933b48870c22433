"""The names vLLM scripts reach for, at vLLM's module paths, and the error wording they match on
(issue #27 items 3 and 4), on tiny checkpoints."""

from __future__ import annotations

import pytest

import ferrollm as vllm
from ferrollm import LLM, SamplingParams, TextPrompt, TokensPrompt
from ferrollm.exceptions import InvalidRequestError, VLLMValidationError
from ferrollm.logprobs import Logprob
from ferrollm.sampling_params import BeamSearchParams


def test_names_live_at_vllms_module_paths():
    from ferrollm.inputs import TextPrompt as T, TokensPrompt as K

    assert (T, K) == (TextPrompt, TokensPrompt) and vllm.inputs.TokensPrompt is TokensPrompt
    assert vllm.logprobs.Logprob is Logprob is vllm.outputs.Logprob
    assert issubclass(InvalidRequestError, VLLMValidationError) and issubclass(VLLMValidationError, ValueError)
    assert str(VLLMValidationError("bad", parameter="p", value=1)) == "bad"
    params = BeamSearchParams(beam_width=3, max_tokens=8)
    assert (params.beam_width, params.length_penalty, params.temperature) == (3, 1.0, 0.0)
    with pytest.raises(ValueError, match="`beam_width` must be >= 1. Given: 0"):
        BeamSearchParams(beam_width=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm(tiny_llama):
    path, _ = tiny_llama
    with LLM(str(path), max_model_len=64) as llm:
        yield llm


def test_prompts_typed_as_vllms_dicts_generate(llm):
    greedy = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    text, tokens = llm.generate([TextPrompt(prompt="Hello"), TokensPrompt(prompt_token_ids=[1, 5, 6])], greedy,
                                use_tqdm=False)
    assert text.prompt == "Hello" and tokens.prompt_token_ids == [1, 5, 6]
    with pytest.raises(VLLMValidationError, match="`multi_modal_data` of prompt 0 .*multimodal"):
        llm.generate(TextPrompt(prompt="Hi", multi_modal_data={"image": object()}), greedy, use_tqdm=False)


def test_model_config_and_vllm_config_read_like_vllms(llm, tiny_llama):
    _, hf_model = tiny_llama
    mc = llm.model_config
    assert mc.hf_config.vocab_size == hf_model.config.vocab_size == mc.get_vocab_size()
    assert mc.max_model_len == 64
    cfg = llm.llm_engine.vllm_config
    assert cfg.model_config is mc and cfg.scheduler_config.max_num_seqs == 256
    assert cfg.cache_config.block_size == 16 and cfg.cache_config.num_gpu_blocks > 0
    assert cfg.parallel_config.world_size == 1 and cfg.load_config.load_format == "auto"
    assert llm.get_tokenizer()("Hello")["input_ids"][0] == 1


def test_num_unfinished_requests_counts_the_queue(llm):
    engine = llm.llm_engine
    assert engine.get_num_unfinished_requests() == 0
    engine.add_requests(["a", "b"], [[1, 5, 6], [1, 7]], [SamplingParams(max_tokens=2, ignore_eos=True)] * 2)
    assert engine.get_num_unfinished_requests() == 2
    while engine.has_unfinished_requests():
        for out in engine.step():
            engine.generation_runner.release(out.request_id)
    assert engine.get_num_unfinished_requests() == 0


def test_embedding_size_of_a_pooling_model(tiny_bert):
    path, hf_model = tiny_bert
    with LLM(str(path)) as llm:
        assert llm.model_config.embedding_size == hf_model.config.hidden_size
        assert len(llm.embed(["Hello"], use_tqdm=False)[0].outputs.embedding) == llm.model_config.embedding_size


@pytest.mark.parametrize(("prompt", "words", "detail"), [
    ({"prompt_token_ids": []}, "The decoder prompt cannot be empty", "`prompt` must be non-empty"),
    ({"prompt_token_ids": [1, 10**6]}, "Token id 1000000 is out of vocabulary", "Given: 1000000"),
    ({"prompt_token_ids": [1] * 64}, "longer than the maximum model length of 64", "has 64 tokens"),
])
def test_prompt_errors_carry_vllms_wording_and_ferrollms_detail(llm, prompt, words, detail):
    with pytest.raises(VLLMValidationError) as info:
        llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    assert words in str(info.value) and detail in str(info.value)


@pytest.mark.parametrize(("kwargs", "words", "detail"), [
    ({"min_tokens": -1}, "min_tokens must be greater than or equal to 0", "Given: -1"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be less than or equal to max_tokens", "Given: 5"),
    ({"temperature": float("nan")}, "temperature must be a finite number", "Given: nan"),
    ({"temperature": float("inf")}, "temperature must be a finite number", "Given: inf"),
    ({"repetition_penalty": float("nan")}, "repetition_penalty must be a finite number", "Given: nan"),
])
def test_sampling_errors_carry_vllms_wording_and_ferrollms_detail(kwargs, words, detail):
    with pytest.raises(VLLMValidationError) as info:
        SamplingParams(**kwargs)
    assert words in str(info.value) and str(info.value).endswith(detail)
