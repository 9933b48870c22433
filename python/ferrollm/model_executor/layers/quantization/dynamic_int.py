"""Integer quantization of a float checkpoint as it loads (no calibration data):

- ``quantization="int8"`` (ferrollm's name; vLLM has no dynamic W8A8 int8 method): W8A8, weights
  int8 symmetric per output channel, activations int8 per token as the product runs. The CPU's
  integer dot products (VNNI, AVX2) make it the fastest form for prefill and batches.
- ``quantization="rtn"`` (vLLM's name for round-to-nearest weight-only quantization): 8-bit
  (default) or 4-bit weights with a scale per group of ``RTN_GROUP_SIZE`` (default 128) columns,
  ``RTN_NUM_BITS`` choosing the width, as vLLM reads them; activations stay float.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from ferrollm.exceptions import ConfigError
from ferrollm.model_executor.layers.quantization import qweights as qw
from ferrollm.model_executor.layers.quantization.base_config import LinearQuantMethod, QuantizationConfig

__all__ = ["Int8Config", "RTNConfig", "quantize_int8_rows", "quantize_rtn"]


class _FromFloat(LinearQuantMethod):
    def __init__(self, quantize):
        self.quantize = quantize
        super().__init__(("weight",))

    def make(self, pieces: dict[str, torch.Tensor]) -> qw.QuantizedWeight:
        return self.quantize(pieces["weight"])


class Int8Config(QuantizationConfig):
    name = "int8"

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> Int8Config:
        return cls()

    def describe(self) -> str:
        return "int8 (dynamic W8A8: int8 weights per channel, int8 activations per token)"

    def get_linear_method(self, prefix: str) -> LinearQuantMethod | None:
        return _FromFloat(quantize_int8_rows)


def quantize_int8_rows(weight: torch.Tensor) -> qw.Int8ActWeight:
    """Symmetric int8 with one scale per row (``max |w_n| / 127``)."""
    w = weight.float()
    scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return qw.Int8ActWeight(q, scale.contiguous())


class RTNConfig(QuantizationConfig):
    name = "rtn"

    def __init__(self, bits: int, group_size: int):
        self.bits, self.group_size = bits, group_size

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> RTNConfig:
        config = config or {}
        bits = int(config.get("bits", os.environ.get("RTN_NUM_BITS", 8)))
        group = int(config.get("group_size", os.environ.get("RTN_GROUP_SIZE", 128)))
        if bits not in (4, 8):
            raise ConfigError(f"`RTN_NUM_BITS` must be 4 or 8. Given: {bits}")
        if group < -1 or group == 0:
            raise ConfigError(f"`RTN_GROUP_SIZE` must be positive or -1 (per channel). Given: {group}")
        return cls(bits, group)

    def describe(self) -> str:
        return f"rtn ({self.bits}-bit weights, group {self.group_size}, float activations)"

    def get_linear_method(self, prefix: str) -> LinearQuantMethod | None:
        return _FromFloat(lambda w: quantize_rtn(w, self.bits, self.group_size))


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int) -> qw.IntWeight:
    """Round-to-nearest with a symmetric scale per group (``max |w| / (2 ** (bits - 1) - 1)``).

    Raises:
        ConfigError: a group size that does not divide the layer's input features.
    """
    w = weight.float()
    out_features, in_features = w.shape
    group = in_features if group_size == -1 else group_size
    if in_features % group:
        raise ConfigError(f"`RTN_GROUP_SIZE` ({group}) must divide every layer's input features; "
                          f"a layer has {in_features}")
    qmax = (1 << (bits - 1)) - 1
    groups = w.reshape(out_features, in_features // group, group)
    scales = (groups.abs().amax(dim=2) / qmax).clamp(min=1e-12)
    q = torch.round(groups / scales[..., None]).clamp(-qmax, qmax).reshape(out_features, in_features)
    if bits == 8:
        return qw.IntWeight(q.to(torch.int8), scales.contiguous(), None, 8, group)
    # 4 bit is stored unsigned (q + 8), the offset in the mins.
    return qw.IntWeight((q + 8).to(torch.uint8), scales.contiguous(), (-8 * scales).contiguous(), 4, group)
