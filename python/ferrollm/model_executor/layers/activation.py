"""Activations: the gated ones of Llama/Gemma-style MLPs, applied to a fused ``[gate, up]``
projection, and the plain element-wise ones HF configs name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.exceptions import UnsupportedModelError

__all__ = ["GeluAndMul", "QuickGELU", "ReLUSquared", "SiluAndMul", "get_act_and_mul", "get_act_fn"]


class SiluAndMul(nn.Module):
    """The gated-MLP activation ``silu(gate) * up`` of a fused ``[gate, up]`` projection.

    Input ``[..., 2 * d]`` (gate first, as ``MergedColumnParallelLinear`` lays it out);
    output ``[..., d]``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if cpu_kernels.supports(x):
            return cpu_kernels.silu_and_mul(x)
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


class QuickGELU(nn.Module):
    """``x * sigmoid(1.702 x)``, the sigmoid approximation of GELU (CLIP-style configs)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ReLUSquared(nn.Module):
    """``relu(x) ** 2`` (Persimmon's and Fuyu's ``relu2``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.square(F.relu(x))


# HF's `hidden_act` / `activation_function` names. gelu_new, gelu_fast and gelu_pytorch_tanh are
# all the tanh approximation written three ways; torch's fused version agrees to float rounding.
_ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "gelu": lambda: nn.GELU(),
    "gelu_new": lambda: nn.GELU(approximate="tanh"),
    "gelu_fast": lambda: nn.GELU(approximate="tanh"),
    "gelu_pytorch_tanh": lambda: nn.GELU(approximate="tanh"),
    "quick_gelu": QuickGELU,
    "relu": lambda: nn.ReLU(),
    "relu2": ReLUSquared,
    "silu": lambda: nn.SiLU(),
    "swish": lambda: nn.SiLU(),
}


def get_act_fn(name: str) -> nn.Module:
    """The element-wise activation an HF config names.

    Args:
        name: e.g. ``"gelu_new"`` (GPT-2), ``"relu"`` (OPT), ``"gelu"`` (GPT-NeoX).

    Returns:
        The module.

    Raises:
        UnsupportedModelError: for a name not in the list, which the message gives.
    """
    factory = _ACTIVATIONS.get(name)
    if factory is None:
        raise UnsupportedModelError(
            f"activation {name!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
        )
    return factory()
