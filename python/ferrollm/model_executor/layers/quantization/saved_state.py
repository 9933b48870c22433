"""Quantized layers in per-rank sharded state (``LLM.save_sharded_state``, ``load_format=
"sharded_state"``): each rank writes its layers' quantized weights, already sharded, in a
layout-neutral form, and reads them back without slicing or re-quantizing.

A layer writes ``<layer>.qweight`` (4-bit values two to a byte, low nibble first; int8; or e4m3
bytes), its scales (``scales``/``mins``/``perm``, or ``weight_scale``/``input_scale``) and
``quant_info``, an int64 vector naming the layout and its settings. GGUF blocks, as the CPU keeps
them, are not written (their files are already per-tensor, mappable and shared: load the .gguf
instead); a GGUF layer on a GPU holds weight-only integers (`gguf_blocks`) and is written as those.
"""

from __future__ import annotations

import torch

from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.layers.quantization import qweights as qw
from ferrollm.model_executor.layers.quantization.base_config import LinearQuantMethod, QuantizationConfig

__all__ = ["SavedStateConfig", "saved_tensors"]

_KINDS = {"IntWeight": 0, "Int8ActWeight": 1, "Fp8Weight": 2}
_INPUT_QUANT = ("none", "tensor", "token", "group", "static")


def saved_tensors(weight: qw.QuantizedWeight | list) -> dict[str, torch.Tensor]:
    """The tensors a quantized layer writes, by name after the layer's (CPU tensors).

    Raises:
        CheckpointError: for GGUF blocks.
    """
    if isinstance(weight, (list, qw.GGUFWeight)):
        raise CheckpointError("save_sharded_state does not write GGUF layers: load the .gguf file itself, "
                              "whose pages the ranks already share")
    cpu = lambda t: t.detach().cpu().contiguous()  # noqa: E731
    if isinstance(weight, qw.IntWeight):
        q = weight.q
        if weight.bits == 4:
            q = torch.nn.functional.pad(q, (0, q.shape[1] % 2))
            q = q[:, 0::2] | (q[:, 1::2] << 4)
        out = {"qweight": cpu(q), "scales": cpu(weight.scales),
               "quant_info": torch.tensor([0, weight.bits, weight.group_size, weight.q.shape[1]])}
        if weight.mins is not None:
            out["mins"] = cpu(weight.mins)
        if weight.perm is not None:
            out["perm"] = cpu(weight.perm)
        return out
    if isinstance(weight, qw.Int8ActWeight):
        out = {"qweight": cpu(weight.q), "weight_scale": cpu(weight.scale),
               "quant_info": torch.tensor([1, weight.input_zero_point, 0, 0])}
    else:
        bo, bi = weight.block or (0, 0)
        out = {"qweight": cpu(weight.q), "weight_scale": cpu(weight.scale),
               "quant_info": torch.tensor([2, bo, bi, _INPUT_QUANT.index(weight.input_quant)])}
    if weight.input_scale is not None:
        out["input_scale"] = torch.tensor([weight.input_scale], dtype=torch.float32)
    return out


class _SavedMethod(LinearQuantMethod):
    # Already this rank's rows and columns: the layer takes them as they are.
    presharded = True

    def __init__(self):
        super().__init__(("input_scale", "mins", "perm", "qweight", "quant_info", "scales", "weight_scale"),
                         optional=("input_scale", "mins", "perm", "scales", "weight_scale"))

    def make(self, pieces: dict[str, torch.Tensor]) -> qw.QuantizedWeight:
        info = pieces["quant_info"].tolist()
        q = pieces["qweight"]
        input_scale = float(pieces["input_scale"][0]) if "input_scale" in pieces else None
        if info[0] == 0:
            bits, group, in_features = info[1:4]
            if bits == 4:
                q = torch.stack([q & 15, q >> 4], dim=-1).reshape(q.shape[0], -1)[:, :in_features].contiguous()
            return qw.IntWeight(q, pieces["scales"], pieces.get("mins"), bits, group, pieces.get("perm"))
        if info[0] == 1:
            return qw.Int8ActWeight(q, pieces["weight_scale"], input_scale, info[1])
        block = (info[1], info[2]) if info[1] else None
        return qw.Fp8Weight(q, pieces["weight_scale"], block, _INPUT_QUANT[info[3]], input_scale)


class SavedStateConfig(QuantizationConfig):
    """Reads sharded state written from a model quantized with ``config``: the same layers are
    quantized, from the saved tensors."""

    name = "sharded-state"

    def __init__(self, config: QuantizationConfig):
        self.config = config
        self.fused = getattr(config, "fused", {})

    def describe(self) -> str:
        return f"{self.config.describe()}, from sharded state"

    def get_linear_method(self, prefix: str) -> LinearQuantMethod | None:
        if hasattr(self.config, "fused"):
            self.config.fused = self.fused  # type: ignore[attr-defined]
        return _SavedMethod() if self.config.get_linear_method(prefix) is not None else None
