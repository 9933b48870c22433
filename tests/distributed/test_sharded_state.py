"""`LLM.save_sharded_state` and ``load_format="sharded_state"``: per-rank files that give the
same outputs, refused at another TP size with both sizes named."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tp_cases import assert_same, run

from ferrollm import LLM
from ferrollm.exceptions import CheckpointError

ROOT = Path(__file__).resolve().parents[2]
ENGINE = dict(max_model_len=128, max_num_seqs=8)


def test_round_trip_at_one_rank_with_parts_and_the_non_weight_files(tiny_llama, tmp_path):
    folder = tiny_llama[0]
    with LLM(str(folder), **ENGINE) as llm:
        expected = run(llm)
        llm.save_sharded_state(str(tmp_path), max_size=40_000)
    parts = sorted(p.name for p in tmp_path.glob("model-rank-*"))
    assert len(parts) > 1 and all(p.startswith("model-rank-0-part-") for p in parts)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in tmp_path.iterdir()}
    assert not (tmp_path / "model.safetensors").exists()
    with LLM(str(tmp_path), load_format="sharded_state", **ENGINE) as llm:
        assert_same(run(llm), expected)


def test_example_script_saves_two_ranks_that_load_back_and_refuse_one(tiny_qwen2, tmp_path):
    folder, out = tiny_qwen2[0], tmp_path / "sharded"
    subprocess.run([sys.executable, str(ROOT / "examples/save_sharded_state.py"), "--model", str(folder),
                    "--tensor-parallel-size", "2", "--output", str(out), "--max-model-len", "128"],
                   check=True, timeout=300)
    assert sorted(p.name for p in out.glob("model-rank-*")) == [
        "model-rank-0-part-0.safetensors", "model-rank-1-part-0.safetensors"]
    with LLM(str(folder), **ENGINE) as llm:
        expected = run(llm)
    with LLM(str(out), load_format="sharded_state", tensor_parallel_size=2, **ENGINE) as llm:
        assert_same(run(llm), expected)
    with pytest.raises(CheckpointError, match=r"saved with tensor_parallel_size=2, but this engine runs tensor_parallel_size=1"):
        LLM(str(out), load_format="sharded_state", **ENGINE)


def test_bf16_round_trip_at_two_ranks_unpacks_the_packed_bf16_weights(tiny_llama, tmp_path):
    # bf16 layers keep only their packed panels: saving rebuilds each plain weight from them, and
    # under TP each rank packed its own slices (strided columns of the row-parallel weights).
    folder, kw = tiny_llama[0], dict(ENGINE, dtype="bfloat16", tensor_parallel_size=2)
    with LLM(str(folder), **kw) as llm:
        expected = run(llm)
        llm.save_sharded_state(str(tmp_path))
    with LLM(str(tmp_path), load_format="sharded_state", **kw) as llm:
        assert_same(run(llm), expected)
