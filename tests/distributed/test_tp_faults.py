"""Faults under tensor parallelism: a worker that dies or raises makes the call raise within
seconds with that worker's story, nothing hangs and no process is left behind; a script without
a ``__main__`` guard is told the fix; options the executor cannot honour are refused."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

from ferrollm import LLM, SamplingParams
from ferrollm.engine.llm_engine import EngineArgs
from ferrollm.exceptions import ConfigError, EngineDeadError, WorkerError
from ferrollm.executor.launch import Rendezvous, rank_device

ENGINE = dict(max_model_len=256, max_num_seqs=4, tensor_parallel_size=2)


def _children() -> list[psutil.Process]:
    # multiprocessing's resource tracker (started with the first spawned process) lives as long
    # as this interpreter and exits with it; it is not one of ours.
    return [c for c in psutil.Process().children(recursive=True)
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE
            and not any("resource_tracker" in part for part in c.cmdline())]


def _wait_gone(pids: list[int], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, f"processes {pids} still alive"
        time.sleep(0.1)


def test_a_worker_killed_mid_generation_raises_and_leaves_no_process(tiny_llama):
    llm = LLM(str(tiny_llama[0]), **ENGINE)
    pids = llm.llm_engine.executor.worker_pids()
    assert len(pids) == 1 and psutil.pid_exists(pids[0])
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    killer = threading.Timer(1.0, os.kill, (pids[0], signal.SIGKILL))
    killer.start()
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 .* died .* exit code -9"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 4 * 50, long, use_tqdm=False)
    assert time.monotonic() - start < 30
    _wait_gone(pids)
    with pytest.raises(EngineDeadError):
        llm.generate("hello", use_tqdm=False)
    llm.close()
    assert _children() == []


def test_a_worker_exception_comes_back_with_its_traceback(tiny_llama):
    llm = LLM(str(tiny_llama[0]), **ENGINE)
    pids = llm.llm_engine.executor.worker_pids()
    with pytest.raises(WorkerError, match=r"(?s)rank 1 raised.*Traceback.*AttributeError.*no_such_method"):
        llm.llm_engine.executor.collective_rpc("no_such_method")
    _wait_gone(pids)
    llm.close()


def test_close_leaves_no_process_and_a_second_engine_starts(tiny_llama):
    outputs = []
    for _ in range(2):
        llm = LLM(str(tiny_llama[0]), **ENGINE)
        pids = llm.llm_engine.executor.worker_pids()
        outputs.append(llm.generate("hello", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0].outputs[0].token_ids)
        llm.close()
        llm.close()
        _wait_gone(pids)
    assert outputs[0] == outputs[1]
    assert not torch.distributed.is_initialized()


def _shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("ferrollm-steps-*")} if Path("/dev/shm").is_dir() else set()


def _run_script(tmp_path, body: str) -> subprocess.CompletedProcess:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180, env=env)


def test_a_script_without_main_guard_is_told_the_fix(tiny_llama, tmp_path):
    before = _shm_files()
    done = _run_script(tmp_path, f"""
        from ferrollm import LLM
        llm = LLM({str(tiny_llama[0])!r}, tensor_parallel_size=2, max_model_len=128)
        print("generated", llm.generate("hi", use_tqdm=False)[0].outputs[0].token_ids)
    """)
    assert done.returncode != 0
    assert "WorkerError" in done.stderr and 'if __name__ == "__main__":' in done.stderr, done.stderr[-3000:]
    assert _shm_files() <= before  # the step channel's file went with the failed start


def test_interpreter_exit_without_close_leaves_no_process(tiny_llama, tmp_path):
    done = _run_script(tmp_path, f"""
        import os
        from ferrollm import LLM
        if __name__ == "__main__":
            llm = LLM({str(tiny_llama[0])!r}, tensor_parallel_size=2, max_model_len=128)
            print("pids", *llm.llm_engine.executor.worker_pids())
            llm.generate("hi", use_tqdm=False)
    """)
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [int(p) for p in done.stdout.split("pids")[1].split()]
    _wait_gone(pids)


def test_options_the_executor_cannot_honour_are_refused():
    with pytest.raises(ConfigError, match="Ray is not supported"):
        EngineArgs(model="m", tensor_parallel_size=2, distributed_executor_backend="ray").validate()
    with pytest.raises(ConfigError, match=r"`tensor_parallel_size` must be an int >= 1 and <= 64. Given: 0"):
        EngineArgs(model="m", tensor_parallel_size=0).validate()


def test_rank_i_takes_the_ith_visible_gpu(monkeypatch):
    cuda = torch.device("cuda")
    assert rank_device(cuda, 1, 2, num_gpus=2) == torch.device("cuda", 1)
    assert rank_device(torch.device("cpu"), 1, 2) == torch.device("cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ConfigError, match=r"\(2\) must be <= the number of visible GPUs \(1, CUDA_VISIBLE_DEVICES='3'\)"):
        rank_device(cuda, 0, 2, num_gpus=1)
    with pytest.raises(ConfigError, match="choose the GPUs with CUDA_VISIBLE_DEVICES"):
        rank_device(torch.device("cuda", 1), 0, 2, num_gpus=4)


def test_rendezvous_follows_master_addr_and_port(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "10.1.2.3")
    monkeypatch.setenv("MASTER_PORT", "29555")
    assert Rendezvous.from_env().init_method == "tcp://10.1.2.3:29555"
    monkeypatch.delenv("MASTER_PORT")
    assert Rendezvous.from_env().port > 0


def test_workers_exit_when_the_parent_is_killed(tiny_llama, tmp_path):
    before = _shm_files()
    done = _run_script(tmp_path, f"""
        import os, signal
        from ferrollm import LLM
        if __name__ == "__main__":
            llm = LLM({str(tiny_llama[0])!r}, tensor_parallel_size=2, max_model_len=128)
            print("pids", *llm.llm_engine.executor.worker_pids(), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    assert done.returncode == -signal.SIGKILL
    _wait_gone([int(p) for p in done.stdout.split("pids")[1].split()])
    assert _shm_files() <= before
