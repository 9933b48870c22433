"""GPTQ (``quant_method: gptq``) and AWQ (``quant_method: awq``) checkpoints, as AutoGPTQ,
GPTQModel and AutoAWQ write them. vLLM's GPU kernel names for them (``gptq_marlin``,
``awq_marlin``) are accepted and run as the plain method.

GPTQ: ``qweight`` int32 ``[in * bits / 32, out]`` (packed along the input), ``qzeros`` int32
``[groups, out * bits / 32]`` holding each zero point minus one (the v1 format every writer still
uses; ``checkpoint_format: gptq_v2`` stores them as they are), ``scales`` ``[groups, out]`` and
``g_idx`` ``[in]`` (the group of each input column; out of order with ``desc_act``).
``w[k, n] = (q[k, n] - zero[g_idx[k], n]) * scales[g_idx[k], n]``.

AWQ (GEMM layout, 4 bit): ``qweight`` int32 ``[in, out / 8]`` and ``qzeros`` ``[groups, out / 8]``,
packed along the output with the eight nibbles of a word in AWQ's order; ``scales`` ``[groups, out]``.
"""

from __future__ import annotations

from typing import Any

import torch

from ferrollm.exceptions import ConfigError
from ferrollm.model_executor.layers.quantization import qweights as qw
from ferrollm.model_executor.layers.quantization.base_config import LinearQuantMethod, QuantizationConfig, matches_any
from ferrollm.model_executor.layers.quantization.compressed_tensors import act_order
from ferrollm.model_executor.layers.quantization.int_packing import AWQ_ORDER, unpack_int32

__all__ = ["AWQConfig", "GPTQConfig"]


def _modules_to_skip(config: dict[str, Any]) -> list[str]:
    return list(config.get("modules_to_not_convert") or []) + list(config.get("ignored_layers") or [])


def _weight(q_unsigned: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group: int) -> qw.IntWeight:
    """`IntWeight` from ``[out, in]`` unsigned values and ``[out, groups]`` zero points and scales:
    ``w = (q - zero) * scale``, kept as ``q * scale + mins``."""
    scales = scales.float().contiguous()
    mins = -zeros.float() * scales
    if bits == 4:
        return qw.IntWeight(q_unsigned, scales, mins.contiguous(), 4, group)
    # 8 bit: signed values, the offset folded into the mins.
    q = (q_unsigned.to(torch.int16) - 128).to(torch.int8)
    return qw.IntWeight(q, scales, (mins + 128 * scales).contiguous(), 8, group)


class GPTQConfig(QuantizationConfig):
    name = "gptq"
    aliases = ("gptq_marlin",)

    def __init__(self, bits: int, group_size: int, desc_act: bool, v2: bool, skip: list[str]):
        self.bits, self.group_size, self.desc_act, self.v2, self.skip = bits, group_size, desc_act, v2, skip
        self.fused: dict[str, tuple[str, ...]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> GPTQConfig:
        config = config or {}
        bits = int(config.get("bits", 4))
        if bits not in (4, 8):
            raise ConfigError(f"GPTQ `bits` must be 4 or 8. Given: {bits}")
        fmt = config.get("checkpoint_format", "gptq")
        if fmt not in ("gptq", "gptq_v2"):
            raise ConfigError(f"GPTQ checkpoint_format must be 'gptq' or 'gptq_v2'. Given: {fmt!r}")
        return cls(bits, int(config.get("group_size", 128)), bool(config.get("desc_act", False)),
                   fmt == "gptq_v2", _modules_to_skip(config))

    def describe(self) -> str:
        return f"gptq ({self.bits} bit, group {self.group_size}, desc_act={self.desc_act})"

    def get_linear_method(self, prefix: str) -> LinearQuantMethod | None:
        if matches_any(prefix, self.skip, self.fused):
            return None
        return _GPTQMethod(self)


class _GPTQMethod(LinearQuantMethod):
    def __init__(self, config: GPTQConfig):
        self.config = config
        super().__init__(("g_idx", "qweight", "qzeros", "scales"), optional=("g_idx",))

    def make(self, pieces: dict[str, torch.Tensor]) -> qw.QuantizedWeight:
        c = self.config
        scales = pieces["scales"].t()  # [out, groups]
        out_features = scales.shape[0]
        q = unpack_int32(pieces["qweight"], c.bits, pieces["qweight"].shape[0] * 32 // c.bits, dim=0).t()
        in_features = q.shape[1]
        zeros = unpack_int32(pieces["qzeros"], c.bits, out_features, dim=1).t().to(torch.int16)
        if not c.v2:
            zeros = zeros + 1
        group = in_features if c.group_size == -1 else c.group_size
        weight = _weight(q.contiguous(), zeros, scales, c.bits, group)
        if "g_idx" in pieces and c.desc_act:
            return act_order(weight, pieces["g_idx"])
        return weight


class AWQConfig(QuantizationConfig):
    name = "awq"
    aliases = ("awq_marlin",)

    def __init__(self, group_size: int, zero_point: bool, skip: list[str]):
        self.group_size, self.zero_point, self.skip = group_size, zero_point, skip
        self.fused: dict[str, tuple[str, ...]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> AWQConfig:
        config = config or {}
        bits = int(config.get("bits", config.get("w_bit", 4)))
        version = str(config.get("version", "gemm")).lower()
        if bits != 4 or version != "gemm":
            raise ConfigError(f"AWQ supports 4-bit weights in the GEMM layout. Given: bits={bits}, version={version!r}")
        return cls(int(config.get("group_size", config.get("q_group_size", 128))),
                   bool(config.get("zero_point", True)), _modules_to_skip(config))

    def describe(self) -> str:
        return f"awq (4 bit, group {self.group_size})"

    def get_linear_method(self, prefix: str) -> LinearQuantMethod | None:
        if matches_any(prefix, self.skip, self.fused):
            return None
        return _AWQMethod(self)


class _AWQMethod(LinearQuantMethod):
    def __init__(self, config: AWQConfig):
        self.config = config
        # `zero_point: false` files may still carry `qzeros` (gptqmodel writes them, all 8 for
        # its symmetric AWQ); where they do, they are what the file's weights are relative to.
        super().__init__(("qweight", "qzeros", "scales"), optional=() if config.zero_point else ("qzeros",))

    def make(self, pieces: dict[str, torch.Tensor]) -> qw.QuantizedWeight:
        scales = pieces["scales"].t()  # [out, groups]
        out_features = scales.shape[0]
        q = unpack_int32(pieces["qweight"], 4, out_features, dim=1, order=AWQ_ORDER).t()  # [out, in]
        if "qzeros" in pieces:
            zeros = unpack_int32(pieces["qzeros"], 4, out_features, dim=1, order=AWQ_ORDER).t()
        else:
            zeros = torch.full_like(scales, 8, dtype=torch.uint8)
        group = q.shape[1] if self.config.group_size == -1 else self.config.group_size
        return _weight(q.contiguous(), zeros, scales, 4, group)
