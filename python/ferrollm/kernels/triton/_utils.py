"""Checks shared by the kernel wrappers."""

from __future__ import annotations

import torch


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    """Kernels index the last dimension with unit stride; every other stride is passed in."""
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"`{name}` must be contiguous in its last dimension. Given strides: {t.stride()}")
