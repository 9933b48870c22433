"""`ferrollm serve`'s flags: generated from the engine's option list, parsed into `EngineArgs`."""

from __future__ import annotations

import pytest

from ferrollm.cli import _parser
from ferrollm.engine.arg_utils import EngineArgs
from ferrollm.entrypoints.openai.cli_args import engine_args_from


def _parse(*argv: str):
    args = _parser().parse_args(["serve", *argv])
    args.model = args.model_tag or args.model
    return args


def test_engine_flags_reach_engine_args():
    args = _parse("some/model", "--max-model-len", "64", "--tensor-parallel-size", "2", "--no-enable-prefix-caching",
                  "--hf-overrides", '{"num_hidden_layers": 1}', "--gpu-memory-utilization", "0.5", "--dtype", "float32")
    ea = engine_args_from(args)
    assert (ea.model, ea.max_model_len, ea.tensor_parallel_size) == ("some/model", 64, 2)
    assert ea.enable_prefix_caching is False and ea.hf_overrides == {"num_hidden_layers": 1}
    assert ea.gpu_memory_utilization == 0.5 and ea.dtype == "float32"
    assert ea.max_num_seqs == EngineArgs(model="m").max_num_seqs  # unset flags keep the defaults


def test_server_flags_have_vllms_names_and_defaults():
    args = _parse("m", "--served-model-name", "a", "b", "--api-key", "k", "--chat-template", "{{ x }}")
    assert (args.host, args.port, args.served_model_name, args.api_key) == ("0.0.0.0", 8000, ["a", "b"], "k")
    assert args.chat_template == "{{ x }}"


def test_an_option_ferrollm_refuses_has_no_flag(capsys):
    with pytest.raises(SystemExit):
        _parse("m", "--enable-lora")
    assert "unrecognized arguments: --enable-lora" in capsys.readouterr().err
