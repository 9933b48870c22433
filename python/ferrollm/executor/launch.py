"""What every rank agrees on before it starts: the rendezvous address, its device and its CPU
threads; and the check that refuses to start workers from a script without a ``__main__`` guard.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
from dataclasses import dataclass

import torch

from ferrollm.exceptions import ConfigError

MAIN_GUARD_HELP = (
    "ferrollm starts tensor-parallel workers with the 'spawn' method, which re-imports your main "
    "script in every worker; this script builds the LLM at import time, so each worker would start "
    "its own engine. Put the code that builds and uses the LLM under\n\n"
    "    if __name__ == \"__main__\":\n        main()\n\n"
    "(see https://docs.python.org/3/library/multiprocessing.html#the-spawn-and-forkserver-start-methods)"
)


@dataclass(frozen=True)
class Rendezvous:
    """Where ``torch.distributed`` ranks meet: ``MASTER_ADDR``/``MASTER_PORT`` when set, else
    the loopback address and a free port."""

    addr: str
    port: int

    @property
    def init_method(self) -> str:
        return f"tcp://{self.addr}:{self.port}"

    @classmethod
    def from_env(cls) -> Rendezvous:
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = os.environ.get("MASTER_PORT")
        if port is not None:
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"`MASTER_PORT` must be a port number in [1, 65535]. Given: {port!r}")
            return cls(addr, int(port))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return cls(addr, s.getsockname()[1])


def check_not_bootstrapping() -> None:
    """Raises if this process is a spawned child still importing the parent's main script.

    Raises:
        RuntimeError: naming the ``if __name__ == "__main__":`` fix. The message is also written
            where the parent reads it (``FERROLLM_STARTUP_ERROR_FILE``) so the caller sees it.
    """
    if not getattr(multiprocessing.current_process(), "_inheriting", False):
        return
    path = os.environ.get("FERROLLM_STARTUP_ERROR_FILE")
    if path:
        with open(path, "w") as f:
            f.write(MAIN_GUARD_HELP)
    raise RuntimeError(MAIN_GUARD_HELP)


def rank_device(device: torch.device, rank: int, world_size: int, num_gpus: int | None = None) -> torch.device:
    """The device of ``rank``: the CPU, or the ``rank``-th GPU that ``CUDA_VISIBLE_DEVICES``
    leaves visible.

    Args:
        device: the engine's device (``cpu`` or ``cuda``).
        num_gpus: visible GPUs (default: ``torch.cuda.device_count()``).

    Raises:
        ConfigError: if fewer GPUs are visible than ranks, or a GPU index was given.
    """
    if device.type == "cpu":
        return device
    if device.index not in (None, 0) and world_size > 1:
        raise ConfigError(
            f"`device` must be 'cuda' (not {str(device)!r}) with tensor_parallel_size={world_size}: "
            "rank i uses the i-th visible GPU; choose the GPUs with CUDA_VISIBLE_DEVICES")
    num_gpus = torch.cuda.device_count() if num_gpus is None else num_gpus
    if num_gpus < world_size:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise ConfigError(
            f"`tensor_parallel_size` ({world_size}) must be <= the number of visible GPUs ({num_gpus}"
            f"{'' if visible is None else f', CUDA_VISIBLE_DEVICES={visible!r}'})")
    return torch.device("cuda", rank)


def cpu_threads_per_rank(world_size: int) -> int:
    """Cores this process may use, shared evenly between the ranks (at least one each)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // world_size)


def check_tp_shapes(hf_config, world_size: int) -> None:
    """Refuses, before any process starts, a model whose attention heads cannot be split over
    ``world_size`` ranks. KV heads fewer than the ranks are replicated when they divide the TP
    size; the vocabulary is padded (vocab.py), so any vocabulary size works.

    Raises:
        ConfigError: naming the parameter and both sizes.
    """
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    num_heads = getattr(text, "num_attention_heads", None)
    if num_heads is None:
        return
    if num_heads % world_size:
        raise ConfigError(f"`num_attention_heads` ({num_heads}) must be divisible by `tensor_parallel_size` "
                          f"({world_size})")
    num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
    if num_kv_heads >= world_size and num_kv_heads % world_size:
        raise ConfigError(f"`num_key_value_heads` ({num_kv_heads}) must be divisible by `tensor_parallel_size` "
                          f"({world_size})")
    if num_kv_heads < world_size and world_size % num_kv_heads:
        raise ConfigError(f"`tensor_parallel_size` ({world_size}) must be a multiple of `num_key_value_heads` "
                          f"({num_kv_heads}) when there are fewer KV heads than ranks (each is replicated)")
