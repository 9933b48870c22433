"""CompilationConfig and CompilationLevel as vLLM's LLM accepts them, the capture sizes they
decide, and decode-batch padding."""

from __future__ import annotations

import pytest

from ferrollm.config import CompilationConfig, CompilationLevel
from ferrollm.config.compilation import default_capture_sizes
from ferrollm.engine.llm_engine import EngineArgs
from ferrollm.exceptions import ConfigError

VLLM_DEFAULT_512 = [1, 2, 4] + list(range(8, 256, 8)) + list(range(256, 513, 16))


def test_levels_have_vllms_values():
    assert [int(level) for level in CompilationLevel] == [0, 1, 2, 3]
    assert CompilationLevel.PIECEWISE == 3 and CompilationLevel.NO_COMPILATION.name == "NO_COMPILATION"


@pytest.mark.parametrize("value,level", [
    (None, None), (3, CompilationLevel.PIECEWISE), (CompilationLevel.DYNAMO_ONCE, 2), ({"level": 1}, 1),
    ({"mode": 0}, 0), ({"level": 3, "mode": 3}, 3), (CompilationConfig(level=2), 2),
])
def test_accepts_a_config_a_dict_or_an_int_level(value, level):
    config = CompilationConfig.from_value(value)
    assert config.level == level and config.mode == level
    if level is not None:
        assert isinstance(config.level, CompilationLevel)


def test_a_given_config_is_kept_and_vllm_compile_only_keys_are_ignored():
    config = CompilationConfig(cudagraph_capture_sizes=[4, 1, 2, 4])
    assert CompilationConfig.from_value(config) is config
    assert config.cudagraph_capture_sizes == [1, 2, 4]  # sorted, deduplicated
    parsed = CompilationConfig.from_value({"level": 3, "backend": "inductor", "custom_ops": ["+rms_norm"],
                                           "cudagraph_capture_sizes": [1, 8]})
    assert parsed.cudagraph_capture_sizes == [1, 8]


@pytest.mark.parametrize("value,message", [
    (4, "`level` must be an int in [0, 3] (CompilationLevel). Given: 4"),
    (True, "must be a CompilationConfig, a dict or an int level. Given: bool"),
    ("3", "Given: str"),
    ({"level": -1}, "`level` must be an int in [0, 3]"),
    ({"mode": 2.0}, "`mode` must be an int in [0, 3] (CompilationLevel). Given: 2.0"),
    ({"level": 1, "mode": 3}, "`level` and `mode` name the same setting and must agree. Given: level=1, mode=3"),
    ({"cudagraph_capture_sizes": [1, 0]}, "`cudagraph_capture_sizes` entries must be ints >= 1. Given: [1, 0]"),
    ({"cudagraph_capture_sizes": 8}, "`cudagraph_capture_sizes` must be a list of ints. Given: 8"),
    ({"max_cudagraph_capture_size": -8}, "`max_cudagraph_capture_size` must be an int >= 0. Given: -8"),
    ({"cudagraph_mode": "SOMETIMES"}, "`cudagraph_mode` must be one of"),
    ({"cuda_graph_sizes": [1]}, "unknown keys ['cuda_graph_sizes']"),
])
def test_bad_values_name_the_field_the_bound_and_the_value(value, message):
    with pytest.raises(ConfigError) as info:
        CompilationConfig.from_value(value)
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_default_sizes_follow_vllm_and_are_capped_by_max_num_seqs():
    assert default_capture_sizes(512) == VLLM_DEFAULT_512
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16]
    config = CompilationConfig()
    # vLLM's default ceiling is min(2 * max_num_seqs, 512); decode batches never exceed
    # max_num_seqs, so sizes past the first one that holds max_num_seqs are dropped.
    assert config.init_capture_sizes(max_num_seqs=256, max_num_batched_tokens=8192) == VLLM_DEFAULT_512[: VLLM_DEFAULT_512.index(256) + 1]
    assert config.capture_sizes[-1] == 256
    assert config.init_capture_sizes(max_num_seqs=10, max_num_batched_tokens=8192) == [1, 2, 4, 8, 16]
    assert config.init_capture_sizes(max_num_seqs=300, max_num_batched_tokens=8192)[-3:] == [272, 288, 304]
    assert config.init_capture_sizes(max_num_seqs=1024, max_num_batched_tokens=8192) == VLLM_DEFAULT_512
    assert config.init_capture_sizes(max_num_seqs=64, max_num_batched_tokens=24) == [1, 2, 4, 8, 16, 24]


def test_given_sizes_are_kept_up_to_max_num_batched_tokens_and_max_num_seqs():
    config = CompilationConfig(cudagraph_capture_sizes=[1, 3, 5, 100, 9000])
    assert config.init_capture_sizes(max_num_seqs=256, max_num_batched_tokens=8192) == [1, 3, 5, 100]
    assert config.init_capture_sizes(max_num_seqs=4, max_num_batched_tokens=8192) == [1, 3, 5]
    limited = CompilationConfig(max_cudagraph_capture_size=64)
    assert limited.init_capture_sizes(256, 8192)[-1] == 64
    with pytest.raises(ConfigError, match=r"`max_cudagraph_capture_size` must equal .* \(100\). Given: 64"):
        CompilationConfig(cudagraph_capture_sizes=[1, 100], max_cudagraph_capture_size=64).init_capture_sizes(256, 8192)


@pytest.mark.parametrize("config,eager", [
    (CompilationConfig(), True), (CompilationConfig(use_cudagraph=False), False),
    (CompilationConfig(cudagraph_mode="none"), False),
])
def test_eager_configs_capture_nothing(config, eager):
    assert config.init_capture_sizes(256, 8192, enforce_eager=eager) == []
    assert config.pad_for_cudagraph(1) is None


def test_pad_for_cudagraph_rounds_up_to_the_next_captured_size():
    config = CompilationConfig()
    assert config.pad_for_cudagraph(1) is None  # nothing decided yet
    config.init_capture_sizes(max_num_seqs=40, max_num_batched_tokens=8192)
    assert config.capture_sizes == [1, 2, 4, 8, 16, 24, 32, 40]
    padded = {n: config.pad_for_cudagraph(n) for n in (1, 2, 3, 5, 8, 9, 17, 33, 40, 41)}
    assert padded == {1: 1, 2: 2, 3: 4, 5: 8, 8: 8, 9: 16, 17: 24, 33: 40, 40: 40, 41: None}


def test_engine_args_validate_the_compilation_config_first():
    args = EngineArgs(model="unused", compilation_config={"level": 3, "cudagraph_capture_sizes": [1, 2]})
    args.validate()
    assert isinstance(args.compilation_config, CompilationConfig)
    assert args.compilation_config.level == CompilationLevel.PIECEWISE
    with pytest.raises(ConfigError, match="`level` must be an int in"):
        EngineArgs(model="unused", compilation_config=7).validate()


def test_backend_is_the_torch_compile_backend_and_defaults_to_inductor():
    assert CompilationConfig().backend == ""  # "" is inductor, as in vLLM
    assert CompilationConfig.from_value({"level": 3, "backend": "eager"}).backend == "eager"
    with pytest.raises(ConfigError, match="`backend` must be a torch.compile backend name. Given: 3"):
        CompilationConfig(backend=3)
