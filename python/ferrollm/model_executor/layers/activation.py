"""Activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["SiluAndMul"]


class SiluAndMul(nn.Module):
    """The gated-MLP activation ``silu(gate) * up`` of a fused ``[gate, up]`` projection.

    Input ``[..., 2 * d]`` (gate first, as ``MergedColumnParallelLinear`` lays it out);
    output ``[..., d]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
