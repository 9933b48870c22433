"""Ranks started by torchrun (`distributed_executor_backend="external_launcher"`), the path a
multi-node run takes: each rank hosts its own core, rendezvous through MASTER_ADDR/MASTER_PORT."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ferrollm import LLM, SamplingParams
from ferrollm.exceptions import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "torchrun_tensor_parallel.py"
PROMPTS = ["hello world", "the quick brown fox jumps"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torchrun_ranks_generate_what_one_process_does(tiny_llama, tmp_path):
    folder = str(tiny_llama[0])
    out = tmp_path / "rank{rank}.json"
    # Two "nodes" of one rank each, meeting at the master address like a multi-node run.
    procs = [
        subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                          "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
                          str(EXAMPLE), "--model", folder, "--max-tokens", "8", "--output-json", str(out),
                          *[a for p in PROMPTS for a in ("--prompt", p)]],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for port in [_free_port()] for node in (0, 1)
    ]
    for p in procs:
        log, _ = p.communicate(timeout=240)
        assert p.returncode == 0, log[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    with LLM(folder) as llm:
        single = [list(o.outputs[0].token_ids)
                  for o in llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)]
    assert ranks[0] == single
    assert ranks[1] == single


def test_external_launcher_outside_torchrun_names_the_missing_variables(tiny_llama, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ConfigError, match=r"missing: \['RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\]"):
        LLM(str(tiny_llama[0]), tensor_parallel_size=2, distributed_executor_backend="external_launcher")


def test_world_size_must_match_tensor_parallel_size(tiny_llama, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    with pytest.raises(ConfigError, match=r"must equal the launcher's WORLD_SIZE \(2\).*Given: 1"):
        LLM(str(tiny_llama[0]), tensor_parallel_size=1, distributed_executor_backend="external_launcher")
