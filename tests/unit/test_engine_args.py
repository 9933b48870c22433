"""The `EngineArgs` name list (`ferrollm.engine.arg_list`): every vLLM 0.32 option is a field,
accepted at vLLM's default; each refused one raises the documented error naming it."""

from __future__ import annotations

from dataclasses import fields

import pytest

from ferrollm.engine.arg_list import DEFAULT_CONFIG, ENGINE_ARGS, GROUP_REASONS
from ferrollm.engine.arg_utils import EngineArgs, check_known_names
from ferrollm.exceptions import ConfigError, UnsupportedOptionError

REFUSED = [a for a in ENGINE_ARGS if a.works is None]


class NonDefault:
    def __repr__(self) -> str:
        return "<a non-default value>"


def vllm_default(arg):
    return None if arg.default == DEFAULT_CONFIG else arg.default


def test_fields_are_the_name_list_in_vllm_order():
    assert [f.name for f in fields(EngineArgs)] == [a.name for a in ENGINE_ARGS]
    assert len([a for a in ENGINE_ARGS if a.group != "ferrollm"]) == 256  # vLLM 0.32's count


def test_every_entry_works_or_says_why():
    for a in ENGINE_ARGS:
        assert (a.works is None) != (a.refused is None), a.name
        assert a.group in GROUP_REASONS, a.name


@pytest.mark.parametrize("arg", ENGINE_ARGS, ids=lambda a: a.name)
def test_every_name_is_accepted_at_vllms_default(arg):
    args = EngineArgs(**{"model": "m", arg.name: vllm_default(arg)})
    args.validate()
    check_known_names({arg.name: None})


@pytest.mark.parametrize("arg", REFUSED, ids=lambda a: a.name)
def test_each_refused_name_raises_naming_it_the_value_and_why(arg):
    with pytest.raises(UnsupportedOptionError) as e:
        EngineArgs(model="m", **{arg.name: NonDefault()})
    msg = str(e.value)
    assert f"`{arg.name}=<a non-default value>`" in msg and arg.refused in msg
    assert isinstance(e.value, NotImplementedError) and isinstance(e.value, ValueError)


def test_all_defaults_at_once_are_accepted():
    EngineArgs(model="m", **{a.name: vllm_default(a) for a in ENGINE_ARGS if a.name != "model"}).validate()


def test_an_unknown_keyword_is_a_type_error_naming_the_closest_option():
    with pytest.raises(TypeError, match="unexpected keyword argument 'max_num_seq'.*'max_num_seqs'"):
        check_known_names({"max_num_seq": 8})
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        EngineArgs(model="m", not_an_option=1)


def test_working_options_keep_ferrollms_defaults_and_resolve_none():
    args = EngineArgs(model="m")
    assert (args.max_num_seqs, args.block_size, args.enable_prefix_caching) == (256, 16, True)
    assert args.seed is None and args.gpu_memory_utilization == 0.9


def test_a_working_option_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineArgs(model="m", max_num_seqs=0).validate()


def test_empty_containers_and_none_stand_for_default_configs():
    EngineArgs(model="m", structured_outputs_config={}, offload_params=None, limit_mm_per_prompt=None,
               ignore_patterns=["original/**/*"], optimization_level=2)


def test_readme_compatibility_table_is_what_the_script_prints():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location("compat_table", root / "tools" / "compat_table.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    readme = (root / "README.md").read_text()
    block = readme.split(tool.START)[1].split(tool.END)[0]
    assert block == tool.compat_table(), "run: python tools/compat_table.py README.md"


def test_capture_size_shorthands_fold_into_compilation_config():
    args = EngineArgs(model="m", cudagraph_capture_sizes=[1, 2, 4], max_cudagraph_capture_size=4)
    args.validate()
    assert args.compilation_config.cudagraph_capture_sizes == [1, 2, 4]
    assert args.compilation_config.max_cudagraph_capture_size == 4
    with pytest.raises(ConfigError, match="mutually exclusive"):
        EngineArgs(model="m", cudagraph_capture_sizes=[1], compilation_config={"cudagraph_capture_sizes": [2]}).validate()
