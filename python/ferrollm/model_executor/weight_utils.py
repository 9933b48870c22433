"""Copying checkpoint tensors into parameters, with the checks that turn a mismatched checkpoint
into a readable error instead of a silent broadcast or a torch shape error deep in a loader."""

from __future__ import annotations

import torch

from ferrollm.exceptions import CheckpointError

__all__ = ["check_shape", "copy_weight", "default_weight_loader"]


def check_shape(expected: tuple[int, ...], src: torch.Tensor, what: str = "weight") -> None:
    """Raises unless ``src`` has shape ``expected``.

    Raises:
        CheckpointError: naming ``what`` and both shapes.
    """
    if tuple(src.shape) != tuple(expected):
        raise CheckpointError(
            f"{what}: the checkpoint tensor has shape {tuple(src.shape)}, the model expects "
            f"{tuple(expected)}; does config.json match the weights?"
        )


def copy_weight(dst: torch.Tensor, src: torch.Tensor, what: str = "weight") -> None:
    """Copies ``src`` into ``dst`` (casting dtype) after checking the shapes agree.

    Args:
        dst: the parameter, or the slice of it, to fill.
        src: the checkpoint tensor, or the slice of it, for this rank.
        what: how to name the tensor in the error.

    Raises:
        CheckpointError: if the shapes differ.
    """
    check_shape(dst.shape, src, what)
    with torch.no_grad():
        dst.copy_(src)


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Loader of parameters that are not sharded: copies the whole tensor.

    Args:
        param: the parameter.
        loaded_weight: the checkpoint tensor.
    """
    copy_weight(param.data, loaded_weight)
