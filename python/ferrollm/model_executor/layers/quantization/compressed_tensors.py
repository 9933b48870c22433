"""compressed-tensors checkpoints (``quant_method: compressed-tensors``), as Red Hat AI / Neural
Magic publish them and llm-compressor writes them.

``config_groups`` name, per group of target layers, how weights (and inputs) are quantized; the
tensors a layer stores depend on the group's ``format``:

- ``pack-quantized``: int4/int8 weights packed into int32 along the input (``weight_packed``
  ``[out, in * bits / 32]``, values offset by ``2 ** (bits - 1)``), ``weight_scale`` per group or
  channel, ``weight_zero_point`` (asymmetric; packed along the output) and ``weight_g_idx``
  (act-order). Runs as weight-only (`IntWeight`).
- ``int-quantized`` / ``naive-quantized``: int8 ``weight`` with ``weight_scale``; with input
  activations it is W8A8 (`Int8ActWeight`), without it weight-only.
- ``float-quantized``: float8_e4m3fn ``weight``, ``weight_scale`` per tensor, channel or block,
  and ``input_scale`` for static inputs (`Fp8Weight`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ferrollm.exceptions import CheckpointError, ConfigError
from ferrollm.model_executor.layers.quantization import qweights as qw
from ferrollm.model_executor.layers.quantization.base_config import LinearQuantMethod, QuantizationConfig, matches_any
from ferrollm.model_executor.layers.quantization.int_packing import unpack_int32

__all__ = ["CompressedTensorsConfig"]

SUPPORTED = ("pack-quantized with 4 or 8 bit int weights (W4A16, W8A16; group or channel, symmetric or "
             "not, act-order)", "int-quantized W8A8 (int8 channel/tensor weights, dynamic per-token or static "
             "per-tensor int8 inputs)", "float-quantized FP8 (e4m3 tensor/channel/block weights; none, "
             "dynamic token/tensor/group or static tensor inputs)")


@dataclass
class _Scheme:
    targets: list[str]
    weights: dict[str, Any]
    inputs: dict[str, Any] | None
    format: str


class CompressedTensorsConfig(QuantizationConfig):
    name = "compressed-tensors"

    def __init__(self, schemes: list[_Scheme], ignore: list[str]):
        self.schemes, self.ignore = schemes, ignore
        self.fused: dict[str, tuple[str, ...]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> CompressedTensorsConfig:
        config = config or {}
        default_format = config.get("format") or "dense"
        schemes = []
        for name, group in (config.get("config_groups") or {}).items():
            if group.get("weights") is None:
                raise ConfigError(f"compressed-tensors group {name!r} quantizes no weights; supported: {SUPPORTED}")
            schemes.append(_Scheme(list(group.get("targets") or []), group["weights"],
                                   group.get("input_activations"), group.get("format") or default_format))
        if config.get("sparsity_config"):
            raise ConfigError("compressed-tensors sparsity (sparsity_config) is not supported")
        return cls(schemes, list(config.get("ignore") or []))

    def describe(self) -> str:
        kinds = sorted({f"{s.format} w{s.weights.get('num_bits')}" for s in self.schemes})
        return f"compressed-tensors ({', '.join(kinds)})"

    def get_linear_method(self, prefix: str) -> LinearQuantMethod | None:
        if matches_any(prefix, self.ignore, self.fused):
            return None
        for scheme in self.schemes:
            if "Linear" in scheme.targets or matches_any(prefix, scheme.targets, self.fused):
                return _method(scheme)
        return None


def _method(scheme: _Scheme) -> LinearQuantMethod:
    w, fmt = scheme.weights, scheme.format
    kind, bits = w.get("type", "int"), int(w.get("num_bits", 8))
    if fmt == "pack-quantized" and kind == "int" and bits in (4, 8) and scheme.inputs is None:
        return _PackedInt(w)
    if fmt in ("int-quantized", "naive-quantized") and kind == "int" and bits == 8:
        if scheme.inputs is None:
            return _Int8WeightOnly(w)
        return _W8A8(w, scheme.inputs)
    if fmt == "float-quantized" and kind == "float" and bits == 8:
        return _Fp8(w, scheme.inputs)
    raise ConfigError(f"compressed-tensors scheme (format {fmt!r}, {kind}{bits} weights, inputs "
                      f"{scheme.inputs and scheme.inputs.get('type')}) is not supported; supported: {SUPPORTED}")


def _strategy(args: dict[str, Any]) -> str:
    return str(args.get("strategy") or "tensor")


def _group_size(args: dict[str, Any], in_features: int) -> int:
    if _strategy(args) == "group":
        return int(args["group_size"])
    if _strategy(args) in ("channel", "tensor"):
        return in_features
    raise CheckpointError(f"compressed-tensors weight strategy {_strategy(args)!r} is not supported for "
                          "integer weights; supported: group, channel, tensor")


class _PackedInt(LinearQuantMethod):
    def __init__(self, args: dict[str, Any]):
        self.args = args
        self.bits = int(args["num_bits"])
        self.symmetric = bool(args.get("symmetric", True))
        suffixes = ["weight_packed", "weight_scale", "weight_shape"]
        if not self.symmetric:
            suffixes.append("weight_zero_point")
        if args.get("actorder") == "group":
            suffixes.append("weight_g_idx")
        super().__init__(tuple(suffixes), optional=("weight_g_idx",))

    def make(self, pieces: dict[str, torch.Tensor]) -> qw.QuantizedWeight:
        out_features, in_features = (int(v) for v in pieces["weight_shape"].tolist())
        offset = 1 << (self.bits - 1)
        # Stored unsigned: the signed value plus `offset`.
        stored = unpack_int32(pieces["weight_packed"], self.bits, in_features, dim=1)
        group = _group_size(self.args, in_features)
        scales = pieces["weight_scale"].float().reshape(out_features, -1)
        zero = torch.zeros_like(scales)
        if not self.symmetric:
            zp = pieces["weight_zero_point"]
            zero = (unpack_int32(zp, self.bits, out_features, dim=0).float() - offset if zp.dtype == torch.int32
                    else zp.float()).reshape(out_features, -1)
        # w = (stored - offset - zero) * scale
        if self.bits == 4:
            q, mins = stored.to(torch.uint8), -(offset + zero) * scales
        else:
            q = (stored.to(torch.int16) - offset).to(torch.int8)
            mins = None if self.symmetric else -zero * scales
        weight = qw.IntWeight(q, scales.contiguous(), mins, self.bits, group)
        if "weight_g_idx" in pieces:
            return act_order(weight, pieces["weight_g_idx"])
        return weight


def act_order(weight: qw.IntWeight, g_idx: torch.Tensor) -> qw.IntWeight:
    """Stores the columns sorted by their group (GPTQ act-order) so each group is contiguous; the
    product then reads ``x[:, perm]``. In-order ``g_idx`` (no act-order) changes nothing.

    Raises:
        CheckpointError: a group other than the last with other than ``group_size`` columns (the
            last one may end short, where ``group_size`` does not divide the inputs).
    """
    g_idx = g_idx.to(torch.int64)
    in_features, g = weight.q.shape[1], weight.group_size
    in_order = torch.arange(in_features) // g
    if torch.equal(g_idx, in_order):
        return weight
    counts = torch.bincount(g_idx, minlength=weight.scales.shape[1])
    if (counts != torch.bincount(in_order, minlength=len(counts))).any():
        raise CheckpointError(f"act-order g_idx gives groups of {sorted(set(counts.tolist()))} columns; "
                              f"each group must have group_size ({g}), the last one what is left of "
                              f"in_features ({in_features})")
    perm = torch.argsort(g_idx, stable=True)
    return qw.IntWeight(weight.q[:, perm].contiguous(), weight.scales, weight.mins, weight.bits,
                        weight.group_size, perm)


class _Int8WeightOnly(LinearQuantMethod):
    def __init__(self, args: dict[str, Any]):
        self.args = args
        super().__init__(("weight", "weight_scale") + (() if args.get("symmetric", True) else ("weight_zero_point",)))

    def make(self, pieces: dict[str, torch.Tensor]) -> qw.QuantizedWeight:
        q = pieces["weight"].to(torch.int8)
        out_features, in_features = q.shape
        scales = pieces["weight_scale"].float().reshape(out_features, -1) if pieces["weight_scale"].numel() > 1 \
            else pieces["weight_scale"].float().reshape(1, 1).expand(out_features, 1).contiguous()
        mins = None
        if "weight_zero_point" in pieces:
            mins = -pieces["weight_zero_point"].float().reshape(scales.shape) * scales
        return qw.IntWeight(q, scales, mins, 8, in_features // scales.shape[1])


class _W8A8(LinearQuantMethod):
    def __init__(self, weights: dict[str, Any], inputs: dict[str, Any]):
        if not weights.get("symmetric", True):
            raise ConfigError("compressed-tensors W8A8 with asymmetric int8 weights is not supported; "
                              f"supported: {SUPPORTED}")
        if _strategy(weights) not in ("channel", "tensor"):
            raise ConfigError(f"W8A8 weight strategy {_strategy(weights)!r} is not supported (channel, tensor)")
        self.dynamic = bool(inputs.get("dynamic", False))
        if self.dynamic and _strategy(inputs) != "token":
            raise ConfigError(f"W8A8 dynamic input strategy {_strategy(inputs)!r} is not supported (token)")
        suffixes = ["weight", "weight_scale"]
        if not self.dynamic:
            suffixes.append("input_scale")
            if not inputs.get("symmetric", True):
                suffixes.append("input_zero_point")
        super().__init__(tuple(suffixes))

    def make(self, pieces: dict[str, torch.Tensor]) -> qw.QuantizedWeight:
        q = pieces["weight"].to(torch.int8)
        scale = pieces["weight_scale"].float().reshape(-1).expand(q.shape[0]).contiguous()
        input_scale = None if self.dynamic else float(pieces["input_scale"].float().max())
        zp = int(pieces["input_zero_point"].reshape(-1)[0]) if "input_zero_point" in pieces else 0
        return qw.Int8ActWeight(q, scale, input_scale, zp)


class _Fp8(LinearQuantMethod):
    def __init__(self, weights: dict[str, Any], inputs: dict[str, Any] | None):
        self.block = tuple(weights["block_structure"]) if _strategy(weights) == "block" else None
        self.input_quant = _fp8_input_quant(inputs)
        suffixes = ["weight", "weight_scale"] + (["input_scale"] if self.input_quant == "static" else [])
        super().__init__(tuple(suffixes))

    def make(self, pieces: dict[str, torch.Tensor]) -> qw.QuantizedWeight:
        return fp8_weight(pieces["weight"], pieces["weight_scale"], self.block, self.input_quant,
                          pieces.get("input_scale"))


def _fp8_input_quant(inputs: dict[str, Any] | None) -> str:
    if inputs is None:
        return "none"
    strategy = _strategy(inputs)
    if not inputs.get("dynamic", False):
        if strategy != "tensor":
            raise ConfigError(f"static fp8 input strategy {strategy!r} is not supported (tensor)")
        return "static"
    if strategy not in ("token", "tensor", "group"):
        raise ConfigError(f"dynamic fp8 input strategy {strategy!r} is not supported (token, tensor, group)")
    return strategy


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None, input_quant: str,
               input_scale: torch.Tensor | None) -> qw.Fp8Weight:
    """An `Fp8Weight` from a checkpoint's e4m3 ``weight`` and its scale (per tensor: spread over the
    rows, so fused projections with different scales join; per channel; or per block)."""
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise CheckpointError(f"fp8 weights must be float8_e4m3fn. Given: {weight.dtype}")
    q = weight.view(torch.uint8) if weight.dtype == torch.float8_e4m3fn else weight
    scale = scale.float()
    if block is None:
        scale = scale.reshape(-1).expand(q.shape[0]).contiguous() if scale.numel() == 1 else scale.reshape(q.shape[0])
    else:
        scale = scale.reshape(-(-q.shape[0] // block[0]), -(-q.shape[1] // block[1]))
    static = None if input_scale is None else float(input_scale.float().max())
    return qw.Fp8Weight(q, scale, block, input_quant, static)
