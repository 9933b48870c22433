"""`ExternalLauncherExecutor`: ranks started by ``torchrun`` (or any launcher that sets
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), on one machine or several.

This is vLLM's ``distributed_executor_backend="external_launcher"``: every process runs the same
script and builds the same `LLM`, so every rank hosts its own engine core. The cores see the same
requests in the same order and schedule identically, so no step needs to travel between them;
rank 0 samples and broadcasts the sampled ids through ``torch.distributed``, which keeps every
core's state the same. Rendezvous is torch's standard ``env://``, so the ranks may sit on
different nodes: there is no node-local shared memory in this path.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import numpy as np
import torch

from ferrollm.config.model_config import ModelConfig
from ferrollm.exceptions import ConfigError
from ferrollm.worker.worker import CacheOptions, Worker

__all__ = ["ExternalLauncherExecutor"]

# How long a collective may wait for a peer, seconds (the same variable as the spawned executor).
DIST_TIMEOUT_S = float(os.environ.get("FERROLLM_DIST_TIMEOUT", "600"))


class ExternalLauncherExecutor:
    """This process's rank, in a group its launcher started.

    Args:
        model_config: the model (every process builds the same).
        options: KV cache sizing and load format.
        device: ``cpu`` or ``cuda``; a GPU rank takes ``LOCAL_RANK``'s device.
        world_size: ``tensor_parallel_size``; must equal the launcher's ``WORLD_SIZE``.

    Raises:
        ConfigError: if the launcher's variables are missing or disagree with
            ``tensor_parallel_size``.
    """

    def __init__(self, model_config: ModelConfig, options: CacheOptions, device: torch.device, world_size: int):
        import torch.distributed as dist

        from ferrollm.distributed import init_tensor_model_parallel

        rank, launched, local_rank = _launcher_env()
        if launched != world_size:
            raise ConfigError(f"`tensor_parallel_size` must equal the launcher's WORLD_SIZE ({launched}) with "
                              f"distributed_executor_backend='external_launcher'. Given: {world_size}")
        if device.type == "cuda":
            device = torch.device("cuda", local_rank)
            torch.cuda.set_device(device)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method="env://",
                                    rank=rank, world_size=world_size,
                                    timeout=datetime.timedelta(seconds=DIST_TIMEOUT_S))
        init_tensor_model_parallel(rank, world_size)
        self.rank, self.world_size, self.device = rank, world_size, device
        self.driver_worker = Worker(model_config, options, rank, world_size, device)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Runs ``method`` on this rank's worker and returns every rank's result, in rank order,
        as `MultiprocExecutor` does. Every rank runs the same script, so every rank calls it."""
        import torch.distributed as dist

        results: list[Any] = [None] * self.world_size
        dist.all_gather_object(results, getattr(self.driver_worker, method)(*args))
        return results

    def sync_sampled(self, sampled: np.ndarray) -> np.ndarray:
        """Rank 0's sampled ids on every rank (the other ranks' runners do not sample)."""
        import torch.distributed as dist

        ids = torch.from_numpy(np.ascontiguousarray(sampled, dtype=np.int64)).to(self._comm_device)
        dist.broadcast(ids, src=0)
        return ids.cpu().numpy()

    def check_alive(self) -> None:
        """A dead peer surfaces as an error from the next collective (gloo/NCCL timeout)."""

    def shutdown(self, graceful: bool = True) -> None:
        """Leaves the process group if this executor created it."""
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            if graceful:
                dist.barrier()
            dist.destroy_process_group()
        self._owns_group = False

    @property
    def _comm_device(self) -> torch.device:
        # NCCL moves CUDA tensors only; gloo moves CPU tensors.
        return self.device if self.device.type == "cuda" else torch.device("cpu")


def _launcher_env() -> tuple[int, int, int]:
    """``(RANK, WORLD_SIZE, LOCAL_RANK)`` as torchrun sets them."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise ConfigError("distributed_executor_backend='external_launcher' runs under torchrun (or another "
                          f"launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT); missing: {missing}")
    try:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0"))
    except ValueError as e:
        raise ConfigError(f"RANK, WORLD_SIZE and LOCAL_RANK must be integers: {e}") from None
