"""Every invalid input gets a typed error naming the parameter, the bound and the value."""

from __future__ import annotations

import numpy as np
import pytest

from ferrollm import EngineCore, SamplingOptions, Tokenizer
from ferrollm import exceptions as exc


@pytest.fixture
def engine() -> EngineCore:
    return EngineCore(block_size=16, num_blocks=64, max_model_len=128)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "`max_tokens` must be >= 1. Given: 0"),
        ({"temperature": -1.0}, "`temperature` must be >= 0. Given: -1"),
        ({"top_p": 0.0}, "`top_p` must be in (0, 1]. Given: 0"),
        ({"top_k": -2}, "`top_k` must be -1 (disable), 0 (disable) or >= 1. Given: -2"),
        ({"min_p": 1.5}, "`min_p` must be in [0, 1]. Given: 1.5"),
        ({"presence_penalty": 3.0}, "`presence_penalty` must be in [-2, 2]. Given: 3"),
        ({"frequency_penalty": -3.0}, "`frequency_penalty` must be in [-2, 2]. Given: -3"),
        ({"repetition_penalty": 0.0}, "`repetition_penalty` must be a finite number > 0. Given: 0"),
        ({"max_tokens": 4, "min_tokens": 5}, "`min_tokens` must be <= max_tokens (4). Given: 5"),
        ({"stop": [""]}, "`stop` must be a list of non-empty strings"),
    ],
)
def test_invalid_sampling_options_raise_value_errors_naming_the_field(engine, kwargs, message):
    with pytest.raises(exc.InvalidRequestError) as info:
        engine.add_requests(["a"], [[5, 6, 7]], [SamplingOptions(**kwargs)])
    assert isinstance(info.value, ValueError)
    assert message in str(info.value)


def test_prompt_longer_than_max_model_len_is_refused(engine):
    with pytest.raises(exc.PromptTooLongError, match="has 128 tokens, but `max_model_len` is 128"):
        engine.add_requests(["a"], [[5] * 128], [SamplingOptions()])


def test_one_bad_request_queues_none_of_the_batch(engine):
    with pytest.raises(ValueError, match="`max_tokens`"):
        engine.add_requests(["ok", "bad"], [[5], [6]], [SamplingOptions(), SamplingOptions(max_tokens=0)])
    assert not engine.has_unfinished_requests()
    engine.add_requests(["ok"], [[5]], [SamplingOptions(max_tokens=1)])
    assert engine.has_unfinished_requests()


def test_duplicate_and_empty_requests_are_refused(engine):
    engine.add_requests(["a"], [[5]], [SamplingOptions()])
    with pytest.raises(exc.DuplicateRequestError, match="`a`"):
        engine.add_requests(["a"], [[5]], [SamplingOptions()])
    with pytest.raises(exc.InvalidRequestError, match="`prompt` must be non-empty"):
        engine.add_requests(["b"], [[]], [SamplingOptions()])


def test_mismatched_argument_lengths_are_refused(engine):
    with pytest.raises(exc.InvalidRequestError, match=r"`params` must be one entry per request id \(2\). Given: 1 entries"):
        engine.add_requests(["a", "b"], [[5], [6]], [SamplingOptions()])


def test_kv_cache_too_small_names_the_largest_length_that_fits():
    with pytest.raises(exc.KVCacheTooSmallError, match="largest length that fits is 64") as info:
        EngineCore(block_size=16, num_blocks=5, max_model_len=128)
    assert isinstance(info.value, ValueError)
    assert "max_model_len" in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
    ],
)
def test_invalid_engine_options_raise_config_errors(kwargs, param):
    with pytest.raises(exc.ConfigError, match=f"`{param}`"):
        EngineCore(**{"num_blocks": 64, "max_model_len": 128, **kwargs})


def test_update_must_match_the_scheduled_step(engine):
    engine.add_requests(["a"], [[5, 6]], [SamplingOptions()])
    engine.schedule()
    with pytest.raises(exc.StepMismatchError, match=r"one token per scheduled request \(1\)"):
        engine.update(np.array([1, 2], dtype=np.int64))
    with pytest.raises(exc.StepMismatchError, match="token ids"):
        engine.update(np.array([-1], dtype=np.int64))
    engine.update(np.array([1], dtype=np.int64))


def test_text_prompt_without_tokenizer_is_refused(engine):
    with pytest.raises(exc.TokenizerError, match="no tokenizer"):
        engine.add_requests(["a"], ["hello"], [SamplingOptions()])


def test_missing_tokenizer_file_names_the_path(tmp_path):
    with pytest.raises(exc.TokenizerError, match="tokenizer.json"):
        Tokenizer(tmp_path / "tokenizer.json")
