"""vLLM's per-tensor KV cache scales as fp8 checkpoints store them: ``<attention>.k_scale`` and
``<attention>.v_scale`` (or one ``<attention>.kv_scale`` for both, the older name) beside an
attention block's projections. Each sets its `Attention` layer's scale, which the layer uses
only when the KV cache is fp8 (``kv_cache_dtype="fp8"``), as vLLM does; 1.0 where none is given.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ferrollm.attention.layer import Attention
from ferrollm.exceptions import CheckpointError

__all__ = ["apply_kv_scale"]

_SUFFIXES = {".k_scale": ("k_scale",), ".v_scale": ("v_scale",), ".kv_scale": ("k_scale", "v_scale")}


def apply_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Sets the scale named ``name`` on the attention layer under its prefix; returns whether
    ``name`` is a KV cache scale at all.

    Raises:
        CheckpointError: no attention layer under the prefix, more than one value (per-head
            scales), or a value that is not a finite number > 0.
    """
    suffix = next((s for s in _SUFFIXES if name.endswith(s)), None)
    if suffix is None:
        return False
    prefix = name[: -len(suffix)]
    try:
        block = model.get_submodule(prefix)
    except AttributeError:
        block = None
    attn = None if block is None else next((m for m in block.modules() if isinstance(m, Attention)), None)
    if attn is None:
        raise CheckpointError(f"checkpoint tensor {name!r} has no attention layer under {prefix!r} in "
                              f"{type(model).__name__}")
    if tensor.numel() != 1:
        raise CheckpointError(f"checkpoint tensor {name!r} holds {tensor.numel()} scales; the fp8 KV cache takes "
                              "one per tensor")
    value = float(tensor.float().reshape(()))
    if not (math.isfinite(value) and value > 0):
        raise CheckpointError(f"checkpoint tensor {name!r} must be a finite number > 0. Given: {value}")
    for attr in _SUFFIXES[suffix]:
        setattr(attn, attr, value)
    return True
