"""`WorkerProc`: the main loop of a spawned tensor-parallel rank.

It joins the process group, attaches to rank 0's step channel and then waits on that channel
only: a step runs through the same `Worker.execute_model` as rank 0's; ``"control"`` means one
command waits on the control pipe (load the model, size the KV cache, save weights); ``"shutdown"``
ends the loop. Any exception goes back to rank 0 with its traceback, and the process exits, which
also breaks rank 0 out of any collective it waits in. The process exits by itself when its
parent dies.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from ferrollm.config.model_config import ModelConfig
from ferrollm.executor.launch import Rendezvous, rank_device
from ferrollm.worker.worker import CacheOptions, Worker

# How often an idle worker looks up from the channel (and a parent-death watch polls).
POLL_S = 0.5


@dataclass
class WorkerConfig:
    """Everything a spawned rank needs; pickled once, at spawn."""

    rank: int
    world_size: int
    rendezvous: Rendezvous
    backend: str
    timeout_s: float
    device: torch.device
    num_threads: int
    model_config: ModelConfig
    options: CacheOptions
    channel_path: str
    parent_pid: int


def worker_main(config: WorkerConfig, conn) -> None:
    """The spawned process's target."""
    _exit_with_parent(config.parent_pid)
    try:
        proc = WorkerProc(config, conn)
        conn.send(("ready", None))
        proc.run()
    except BaseException:  # noqa: BLE001 - every failure goes back to rank 0
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            sys.stderr.flush()
            # Skip interpreter teardown: gloo's destructors abort while peers are mid-collective.
            os._exit(1)
    os._exit(0)


def _exit_with_parent(parent_pid: int) -> None:
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="ferrollm-parent-watch", daemon=True).start()


class WorkerProc:
    """One spawned rank: process group, step receiver and `Worker`."""

    def __init__(self, config: WorkerConfig, conn):
        import torch.distributed as dist

        from ferrollm._core import StepReceiver
        from ferrollm.distributed import init_tensor_model_parallel

        self.conn = conn
        device = rank_device(config.device, config.rank, config.world_size)
        if device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        else:
            torch.cuda.set_device(device)
        dist.init_process_group(config.backend, init_method=config.rendezvous.init_method, rank=config.rank,
                                world_size=config.world_size,
                                timeout=datetime.timedelta(seconds=config.timeout_s))
        init_tensor_model_parallel(config.rank, config.world_size)
        self.receiver = StepReceiver(config.channel_path, config.rank - 1)
        self.worker = Worker(config.model_config, config.options, config.rank, config.world_size, device)

    def run(self) -> None:
        while True:
            msg = self.receiver.recv(POLL_S)
            if msg is None:
                continue
            if msg == "shutdown":
                break
            if msg == "control":
                method, args = self.conn.recv()
                self.conn.send(("ok", getattr(self.worker, method)(*args)))
            else:
                self.worker.execute_model(msg)
        _leave_group()


def _leave_group() -> None:
    import torch.distributed as dist

    # Every rank meets here before tearing gloo down; one rank leaving while another still
    # has collectives in flight aborts the process.
    dist.barrier()
    dist.destroy_process_group()
