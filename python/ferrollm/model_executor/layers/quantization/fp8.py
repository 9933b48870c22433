"""FP8: checkpoints saved with ``quant_method: fp8`` (per-tensor ``weight_scale``, or block-wise
``weight_scale_inv`` with ``weight_block_size``, as DeepSeek and Qwen publish), and vLLM's dynamic
``quantization="fp8"``, which quantizes a bf16/fp32 checkpoint's weights to float8_e4m3fn with a
per-tensor scale as they load. Activations are quantized as the product runs: per tensor
(dynamic or ``activation_scheme: static``), or per token and 128 columns for block weights.
"""

from __future__ import annotations

from typing import Any

import torch

from ferrollm.exceptions import ConfigError
from ferrollm.model_executor.layers.quantization import qweights as qw
from ferrollm.model_executor.layers.quantization.base_config import LinearQuantMethod, QuantizationConfig, matches_any
from ferrollm.model_executor.layers.quantization.compressed_tensors import fp8_weight

__all__ = ["Fp8Config", "quantize_fp8"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


class Fp8Config(QuantizationConfig):
    name = "fp8"

    def __init__(self, serialized: bool, static_inputs: bool, block: tuple[int, int] | None, skip: list[str]):
        self.serialized, self.static_inputs, self.block, self.skip = serialized, static_inputs, block, skip
        self.fused: dict[str, tuple[str, ...]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> Fp8Config:
        if config is None:  # quantization="fp8" on a float checkpoint
            return cls(False, False, None, [])
        scheme = config.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise ConfigError(f"fp8 activation_scheme must be 'dynamic' or 'static'. Given: {scheme!r}")
        block = config.get("weight_block_size")
        if block is not None and scheme == "static":
            raise ConfigError("fp8 block-wise weights take dynamic activations only (activation_scheme='dynamic')")
        return cls(True, scheme == "static", tuple(block) if block else None,
                   list(config.get("ignored_layers") or []) + list(config.get("modules_to_not_convert") or []))

    def describe(self) -> str:
        if not self.serialized:
            return "fp8 (dynamic: weights quantized at load, per tensor)"
        return f"fp8 (block {self.block})" if self.block else f"fp8 ({'static' if self.static_inputs else 'dynamic'} inputs)"

    def get_linear_method(self, prefix: str) -> LinearQuantMethod | None:
        if matches_any(prefix, self.skip, self.fused):
            return None
        return _Fp8Method(self)


class _Fp8Method(LinearQuantMethod):
    def __init__(self, config: Fp8Config):
        self.config = config
        if not config.serialized:
            suffixes: tuple[str, ...] = ("weight",)
        elif config.block is not None:
            suffixes = ("weight", "weight_scale_inv")
        else:
            suffixes = ("weight", "weight_scale") + (("input_scale",) if config.static_inputs else ())
        super().__init__(suffixes)

    def make(self, pieces: dict[str, torch.Tensor]) -> qw.QuantizedWeight:
        c = self.config
        if not c.serialized:
            return quantize_fp8(pieces["weight"])
        if c.block is not None:
            return fp8_weight(pieces["weight"], pieces["weight_scale_inv"], c.block, "group", None)
        return fp8_weight(pieces["weight"], pieces["weight_scale"], None,
                          "static" if c.static_inputs else "tensor", pieces.get("input_scale"))


def quantize_fp8(weight: torch.Tensor) -> qw.Fp8Weight:
    """A float weight as float8_e4m3fn with one scale (``max |w| / 448``), as vLLM's dynamic fp8."""
    w = weight.float()
    scale = (w.abs().max() / FP8_MAX).clamp(min=1e-12)
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)
    return qw.Fp8Weight(q, scale.reshape(1).expand(w.shape[0]).contiguous(), None, "tensor", None)
