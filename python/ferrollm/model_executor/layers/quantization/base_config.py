"""What every quantization method provides, in vLLM's terms: a `QuantizationConfig` (one per model,
read from ``config.json``'s ``quantization_config`` or named by ``quantization=``) that gives each
linear layer a `LinearQuantMethod`, or None to leave the layer in floating point."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.layers.quantization.qweights import QuantizedWeight

__all__ = ["LinearQuantMethod", "QuantizationConfig", "matches_any"]


@dataclass
class LinearQuantMethod:
    """How one linear layer's checkpoint tensors become a `QuantizedWeight`.

    Attributes:
        suffixes: the checkpoint tensors of one projection, by name after the layer's own
            (``"weight_packed"``, ``"weight_scale"`` ...). The layer registers a placeholder
            parameter under each, so the models' ``load_weights`` route them as they route
            ``weight``.
        optional: suffixes a checkpoint may leave out (GPTQ's ``g_idx`` without act-order).
    """

    suffixes: tuple[str, ...]
    optional: tuple[str, ...] = ()
    params_dtype: dict[str, torch.dtype] = field(default_factory=dict)

    def make(self, pieces: dict[str, torch.Tensor]) -> QuantizedWeight:
        """The projection's weight from its checkpoint tensors (all of ``suffixes`` that came)."""
        raise NotImplementedError


class QuantizationConfig:
    """A model's quantization method and its settings.

    Subclasses set ``name`` (vLLM's ``quantization=`` value) and implement `from_config` (from
    ``config.json``'s ``quantization_config``, or None for a method that quantizes at load) and
    `get_linear_method`.
    """

    name: ClassVar[str]
    # Other names ``quantization=`` may give for the same checkpoints (vLLM's GPU kernel
    # variants, such as ``gptq_marlin``, run here as the plain method).
    aliases: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> QuantizationConfig:
        raise NotImplementedError

    def get_linear_method(self, prefix: str) -> LinearQuantMethod | None:
        """The method for the linear layer named ``prefix`` (its fused name, e.g.
        ``model.layers.0.self_attn.qkv_proj``), or None to keep it unquantized."""
        raise NotImplementedError

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name


def matches_any(prefix: str, patterns: Iterable[str], fused: dict[str, tuple[str, ...]] | None = None) -> bool:
    """Whether a layer name matches one of compressed-tensors' / vLLM's target or ignore entries:
    a plain name (the layer's, or its last component), or ``re:<regex>``. A fused layer
    (``qkv_proj``) matches where all its checkpoint projections (``q_proj`` ...) do; where only some
    do, the layer cannot be half quantized and that is an error."""
    names = [prefix]
    for fused_name, parts in (fused or {}).items():
        if prefix.endswith("." + fused_name) or prefix == fused_name:
            names = [prefix[: len(prefix) - len(fused_name)] + part for part in parts]
    hits = [_match_one(n, patterns) for n in names]
    if any(hits) and not all(hits):
        raise CheckpointError(f"layer {prefix!r} fuses {names}, of which only some are quantized; "
                              "ferrollm runs them as one product and needs them quantized alike")
    return all(hits)


def _match_one(name: str, patterns: Iterable[str]) -> bool:
    for pattern in patterns:
        if pattern.startswith("re:"):
            if re.match(pattern[3:], name):
                return True
        elif name == pattern or name.endswith("." + pattern):
            return True
    return False
