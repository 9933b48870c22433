"""SamplingParams: vLLM's defaults, normalisations and bounds, with messages that name the field,
the bound and the value given."""

from __future__ import annotations

import pytest

import ferrollm
from ferrollm import RequestOutputKind, SamplingParams
from ferrollm.exceptions import InvalidRequestError
from ferrollm.sampling_params import SamplingType

# vLLM's documented defaults for every field ferrollm supports.
VLLM_DEFAULTS: dict[str, object] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "seed": None,
    "stop": [],
    "stop_token_ids": [],
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "detokenize": True,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "output_kind": RequestOutputKind.CUMULATIVE,
    "logit_bias": None,
    "allowed_token_ids": None,
}


def test_defaults_equal_vllms():
    params = SamplingParams()
    for name, value in VLLM_DEFAULTS.items():
        assert getattr(params, name) == value, name
    assert params.sampling_type is SamplingType.RANDOM
    assert not params.is_greedy


# (kwargs, field, bound, given) — the message must contain all three.
INVALID = [
    ({"n": 0}, "n", ">= 1", "0"),
    ({"n": 1.5}, "n", ">= 1", "1.5"),
    ({"best_of": 3, "n": 2}, "best_of", "equal to n (2)", "3"),
    ({"presence_penalty": 2.5}, "presence_penalty", "in [-2, 2]", "2.5"),
    ({"presence_penalty": -2.5}, "presence_penalty", "in [-2, 2]", "-2.5"),
    ({"frequency_penalty": 3.0}, "frequency_penalty", "in [-2, 2]", "3.0"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty", "in [-2, 2]", "nan"),
    ({"repetition_penalty": 0.0}, "repetition_penalty", "a finite number > 0", "0.0"),
    ({"repetition_penalty": -1.0}, "repetition_penalty", "a finite number > 0", "-1.0"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty", "a finite number > 0", "inf"),
    ({"temperature": -1.0}, "temperature", ">= 0", "-1.0"),
    ({"temperature": float("inf")}, "temperature", "finite", "inf"),
    ({"temperature": "hot"}, "temperature", ">= 0", "'hot'"),
    ({"top_p": 0.0}, "top_p", "in (0, 1]", "0.0"),
    ({"top_p": 1.5}, "top_p", "in (0, 1]", "1.5"),
    ({"top_k": -2}, "top_k", "-1 (disable), 0 (disable) or >= 1", "-2"),
    ({"top_k": 2.0}, "top_k", ">= 1", "2.0"),
    ({"min_p": -0.1}, "min_p", "in [0, 1]", "-0.1"),
    ({"min_p": 1.5}, "min_p", "in [0, 1]", "1.5"),
    ({"seed": 2**64}, "seed", "64-bit int", str(2**64)),
    ({"max_tokens": 0}, "max_tokens", ">= 1", "0"),
    ({"min_tokens": -1}, "min_tokens", ">= 0", "-1"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "<= max_tokens (4)", "5"),
    ({"logprobs": -2}, "logprobs", ">= 0", "-2"),
    ({"prompt_logprobs": -5}, "prompt_logprobs", ">= 0", "-5"),
    ({"stop": ["ok", ""]}, "stop", "non-empty strings", "['ok', '']"),
    ({"stop": 3}, "stop", "a list of strings", "3"),
    ({"stop": "x", "detokenize": False}, "stop", "detokenize=False", "['x']"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids", "non-negative ints", "[1, -1]"),
    ({"logit_bias": {"a": 1.0}}, "logit_bias", "token ids", "'a'"),
    ({"logit_bias": {1.5: 1.0}}, "logit_bias", "token ids", "1.5"),
    ({"logit_bias": {3: float("nan")}}, "logit_bias[3]", "finite", "nan"),
    ({"logit_bias": [1, 2]}, "logit_bias", "a dict", "[1, 2]"),
    ({"allowed_token_ids": []}, "allowed_token_ids", "non-empty", "[]"),
    ({"allowed_token_ids": [1, "2"]}, "allowed_token_ids", "non-negative ints", "[1, '2']"),
    ({"output_kind": "delta"}, "output_kind", "RequestOutputKind", "'delta'"),
    ({"temperature": 0.0, "n": 2}, "n", "1 when using greedy sampling", "2"),
]


@pytest.mark.parametrize(("kwargs", "name", "bound", "given"), INVALID)
def test_invalid_values_name_the_field_bound_and_value(kwargs, name, bound, given):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert isinstance(info.value, ValueError)
    assert message.startswith(f"`{name}` must be "), message
    assert bound in message, message
    assert message.endswith(f"Given: {given}"), message


def test_boundary_values_are_accepted():
    SamplingParams(presence_penalty=-2, frequency_penalty=2, repetition_penalty=2.0,
                   top_p=1.0, top_k=1, min_p=1.0, max_tokens=1, min_tokens=1,
                   logprobs=0, prompt_logprobs=0, n=3, best_of=3)
    SamplingParams(max_tokens=None, min_tokens=10_000)
    SamplingParams(logprobs=-1, prompt_logprobs=-1)


def test_vllm_spellings_are_normalised():
    params = SamplingParams(top_k=-1, seed=-1, stop="###", stop_token_ids=[7, 3, 7],
                            logprobs=True, logit_bias={"5": -1, 6: 2.5})
    assert params.top_k == 0
    assert params.seed is None
    assert params.stop == ["###"]
    assert params.stop_token_ids == [7, 3]
    assert params.logprobs == 1
    assert params.logit_bias == {5: -1.0, 6: 2.5}


def test_greedy_resets_the_filters_and_tiny_temperatures_are_raised():
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.is_greedy and greedy.sampling_type is SamplingType.GREEDY
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, 0, 0.0)
    assert SamplingParams(temperature=1e-3).temperature == 1e-2
    assert SamplingParams(seed=3).sampling_type is SamplingType.RANDOM_SEED


def test_clone_is_deep_and_equal():
    params = SamplingParams(stop=["a"], logit_bias={1: 1.0})
    twin = params.clone()
    assert twin == params and twin is not params
    twin.stop.append("b")
    twin.logit_bias[2] = 0.5
    assert params.stop == ["a"] and params.logit_bias == {1: 1.0}


def test_repr_lists_the_fields():
    text = repr(SamplingParams(temperature=0.8, stop=["x"]))
    assert text.startswith("SamplingParams(n=1, ")
    assert "temperature=0.8" in text and "stop=['x']" in text and "max_tokens=16" in text


def test_verify_token_ids_checks_the_vocabulary():
    params = SamplingParams(stop_token_ids=[3], logit_bias={99: 1.0})
    params.verify_token_ids(vocab_size=100)
    with pytest.raises(InvalidRequestError, match=r"`logit_bias` must be token ids < "
                                                  r"vocab_size \(50\). Given: \[99\]"):
        params.verify_token_ids(vocab_size=50)
    with pytest.raises(InvalidRequestError, match="`allowed_token_ids`"):
        SamplingParams(allowed_token_ids=[1, 60]).verify_token_ids(vocab_size=50)


def test_to_core_carries_what_the_core_acts_on():
    params = SamplingParams(max_tokens=5, min_tokens=2, stop=["x"], stop_token_ids=[4],
                            temperature=0.5, top_p=0.9, top_k=7, seed=11, logprobs=-1)
    core = params.to_core()
    assert isinstance(core, ferrollm.SamplingOptions)
    assert core.max_tokens == 5 and core.stop == ["x"] and core.stop_token_ids == [4]
    # The core accepts it and schedules its sampler values.
    engine = ferrollm.EngineCore(block_size=16, num_blocks=16, max_model_len=64)
    engine.add_requests(["r"], [[5, 6, 7]], [params.to_core()])
    step = engine.schedule()
    assert step.temperature.tolist() == [0.5] and step.top_k.tolist() == [7]
    assert step.seeds.tolist() == [11]
    assert SamplingParams(max_tokens=None).to_core().max_tokens is None
