"""`ferrollm bench throughput` / `latency` take the engine's options under vLLM's names, as
`vllm bench` does (a W8A8 run is `--quantization int8`), but not the parallel ones: the peak
RSS the benchmarks report is their own process's."""

from __future__ import annotations

import logging

import pytest

from ferrollm.cli import _parser, main


def test_engine_flags_reach_the_benchmarked_engine(tiny_llama, tmp_path, caplog, capsys):
    path, _ = tiny_llama
    with caplog.at_level(logging.INFO, logger="ferrollm"):
        main(["bench", "throughput", "--model", str(path), "--input-len", "4", "--output-len", "2",
              "--num-prompts", "2", "--quantization", "int8", "--max-model-len", "64", "--dtype", "float32"])
    assert any("quantization: int8" in r.getMessage() for r in caplog.records), caplog.text
    assert "Throughput:" in capsys.readouterr().out


def test_the_benchmarks_keep_their_own_defaults():
    args = _parser().parse_args(["bench", "latency", "--model", "m", "--kv-cache-dtype", "bfloat16"])
    assert (args.seed, args.enable_prefix_caching, args.kv_cache_dtype) == (0, False, "bfloat16")
    assert args.quantization is None and args.dtype is None  # unset: the engine's defaults


def test_parallel_options_are_not_benchmarked(capsys):
    with pytest.raises(SystemExit):
        _parser().parse_args(["bench", "throughput", "--model", "m", "--tensor-parallel-size", "2"])
    assert "unrecognized arguments: --tensor-parallel-size" in capsys.readouterr().err
