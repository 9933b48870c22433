"""This process's place in the tensor-parallel group, and the collectives layers call.

One model runner per rank; each sets its rank once, before building the model, with
:func:`init_tensor_model_parallel`. Until then the process is rank 0 of 1 and the collectives are
no-ops, so single-process runs never touch ``torch.distributed``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ferrollm.exceptions import ConfigError

_TP_RANK = 0
_TP_SIZE = 1
_TP_GROUP: dist.ProcessGroup | None = None


def init_tensor_model_parallel(
    rank: int, world_size: int, group: dist.ProcessGroup | None = None
) -> None:
    """Records this process's tensor-parallel rank.

    Args:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: ``tensor_parallel_size``.
        group: the process group to reduce over; ``None`` means the default group, which must
            already be initialised with ``torch.distributed.init_process_group`` when
            ``world_size > 1``.

    Raises:
        ConfigError: if the rank or size is out of range.
    """
    global _TP_RANK, _TP_SIZE, _TP_GROUP
    if world_size < 1:
        raise ConfigError(f"`tensor_parallel_size` must be >= 1. Given: {world_size}")
    if not 0 <= rank < world_size:
        raise ConfigError(f"tensor-parallel rank must be in [0, {world_size}). Given: {rank}")
    _TP_RANK, _TP_SIZE, _TP_GROUP = rank, world_size, group


def get_tensor_model_parallel_rank() -> int:
    """This process's tensor-parallel rank (0 when not parallel)."""
    return _TP_RANK


def get_tensor_model_parallel_world_size() -> int:
    """The tensor-parallel size (1 when not parallel)."""
    return _TP_SIZE


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sums ``x`` over the ranks, in place; returns ``x``.

    Args:
        x: this rank's partial result.

    Returns:
        The sum over ranks (``x`` itself when there is one rank).
    """
    if _TP_SIZE > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_broadcast(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's ``x`` on every rank, in place; returns ``x``.

    Args:
        x: on rank 0 the data, on the others a tensor of the same shape and dtype to receive it.
    """
    if _TP_SIZE > 1:
        src = 0 if _TP_GROUP is None else dist.get_global_rank(_TP_GROUP, 0)
        dist.broadcast(x, src=src, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenates every rank's ``x`` along ``dim``, in rank order.

    Args:
        x: this rank's shard; every rank's has the same shape.
        dim: the dimension to concatenate along.

    Returns:
        The full tensor (``x`` itself when there is one rank).
    """
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)
