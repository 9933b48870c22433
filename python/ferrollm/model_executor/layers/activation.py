"""Activations of gated MLPs, applied to a fused ``[gate, up]`` projection."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ferrollm.exceptions import UnsupportedModelError

__all__ = ["GeluAndMul", "SiluAndMul", "get_act_and_mul"]


class SiluAndMul(nn.Module):
    """The gated-MLP activation ``silu(gate) * up`` of a fused ``[gate, up]`` projection.

    Input ``[..., 2 * d]`` (gate first, as ``MergedColumnParallelLinear`` lays it out);
    output ``[..., d]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """``gelu(gate) * up`` of a fused ``[gate, up]`` projection (GeGLU).

    Args:
        approximate: ``"none"`` for the exact erf form, ``"tanh"`` for the tanh approximation.
    """

    def __init__(self, approximate: str = "none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


# HF's activation names (transformers' ACT2FN keys) -> the gated module computing the same thing.
_ACT_AND_MUL: dict[str, Callable[[], nn.Module]] = {
    "silu": SiluAndMul,
    "swish": SiluAndMul,
    "gelu": lambda: GeluAndMul("none"),
    "gelu_pytorch_tanh": lambda: GeluAndMul("tanh"),
    # HF's "gelu_new" spells the tanh approximation out by hand; same function.
    "gelu_new": lambda: GeluAndMul("tanh"),
}


def get_act_and_mul(name: str) -> nn.Module:
    """The gated activation of an MLP whose config says ``hidden_act=name``.

    Raises:
        UnsupportedModelError: for an activation not in the supported list.
    """
    factory = _ACT_AND_MUL.get(name)
    if factory is None:
        raise UnsupportedModelError(
            f"hidden_act {name!r} is not supported; supported: {sorted(_ACT_AND_MUL)}"
        )
    return factory()
