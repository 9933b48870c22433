"""GGUF files kept quantized: on the CPU the linear layers read llama.cpp's blocks straight from
the file's mapping through the CPU block kernels (`ferrollm.kernels.cpu.gguf.gguf_linear`), so the
weights cost their file bytes, shared through the page cache, and decode reads 4-6 bits a weight.

Which tensors stay blocks is decided once per file (`GGUFConfig.keeps`): the linear projections
whose type has a kernel (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), when every projection
fused with it does too, and the vocabulary table and LM head of such a type. Norms and any other
type are dequantized at load as before, and logged.

On the CPU the embedding decodes the rows it looks up from the blocks. On a GPU each layer's
form turns this rank's blocks into weight-only integers for the Triton ``wq_linear`` (`gguf_blocks`,
exact): codes and float32 group scales, where 4-bit codes pack two to a byte but 5- and 6-bit
codes take a byte each, so a weight costs more than in the file (Q4_K 6 bits against 4.5, Q6_K
10 against 6.56; a fused layer mixing types keeps each run of alike projections in its own
form). The vocabulary table becomes the same integers, which the LM head multiplies by and the
embedding looks its rows up in (`VocabParallelEmbedding.finish_cpu_weight`). Both are logged.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ferrollm.model_executor.ggml_types import block_size, type_name
from ferrollm.model_executor.layers.quantization import qweights as qw
from ferrollm.model_executor.layers.quantization.base_config import LinearQuantMethod, QuantizationConfig
from ferrollm.model_executor.layers.quantization.gguf_blocks import device_bits, expressible

__all__ = ["GGUFConfig"]

logger = logging.getLogger(__name__)

# The per-layer projections a linear layer reads (HF names), and the fused layers made of them.
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_VOCAB_TABLES = ("model.embed_tokens.weight", "lm_head.weight")


class GGUFConfig(QuantizationConfig):
    name = "gguf"

    def __init__(self, types: dict[str, int] | None = None, device: torch.device | None = None):
        # HF tensor name -> GGML type, for the file being loaded (set by `bind`).
        self.types = types or {}
        self.device = device or torch.device("cpu")
        self.fused: dict[str, tuple[str, ...]] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> GGUFConfig:
        return cls()

    def bind(self, types: dict[str, int], device: torch.device) -> None:
        """The file's tensor types by HF name, and where the model runs."""
        self.types, self.device = types, device
        kept = sorted({t for n, t in types.items() if self.keeps(n)}, key=type_name)
        other = sorted({type_name(t) for n, t in types.items()
                        if not self.keeps(n) and (_is_projection(n) or n in _VOCAB_TABLES)})
        # Float types (F32, F16, BF16) are converted to the run dtype, which is not a dequantization.
        other = [t if t not in ("F32", "F16", "BF16") else f"{t} (float)" for t in other]
        if device.type == "cpu":
            logger.info("GGUF projections kept quantized: %s; dequantized or converted to the run dtype at load: %s",
                        [type_name(t) for t in kept] or "none", other or "none")
            return
        logger.info("GGUF projections kept quantized on %s as codes and float32 group scales for the Triton "
                    "kernels (bits a weight in the file -> on the device; 5- and 6-bit codes take a byte each): "
                    "%s; dequantized or converted to the run dtype at load: %s", device.type,
                    [f"{type_name(t)} {_file_bits(t):.3g} -> {device_bits(t):.3g}" for t in kept] or "none",
                    other or "none")

    def describe(self) -> str:
        if self.device.type == "cpu":
            return "gguf (llama.cpp blocks read in place)"
        return "gguf (llama.cpp blocks as codes and group scales for the Triton kernels)"

    def keeps(self, hf_name: str) -> bool:
        """Whether the tensor stays llama.cpp blocks: a projection with a block kernel, and every
        projection fused with it as well; or the vocabulary table (looked up row by row, and
        multiplied as the LM head) with one."""
        # Off the CPU the Triton kernels read the blocks as integers (`gguf_blocks`), for the
        # same eight types.
        supported = _has_kernel if self.device.type == "cpu" else expressible
        if hf_name in _VOCAB_TABLES:
            return supported(self.types.get(hf_name))
        if not _is_projection(hf_name):
            return False
        layer = hf_name.rsplit(".", 2)[0]
        return all(supported(self.types.get(f"{layer}.{p}.weight")) for p in self._siblings(hf_name))

    def _siblings(self, hf_name: str) -> tuple[str, ...]:
        proj = hf_name.rsplit(".", 2)[1]
        for parts in self.fused.values():
            if proj in parts:
                return parts
        return (proj,)

    def get_linear_method(self, prefix: str) -> LinearQuantMethod | None:
        layer, _, name = prefix.rpartition(".")
        parts = self.fused.get(name, (name,))
        if all(self.keeps(f"{layer}.{p}.weight") for p in parts):
            return _GGUFMethod()
        return None


class _GGUFMethod(LinearQuantMethod):
    def __init__(self):
        super().__init__(("weight",))

    def make(self, pieces: dict[str, torch.Tensor]) -> qw.QuantizedWeight:
        weight = pieces["weight"]
        assert isinstance(weight, qw.GGUFWeight), "the GGUF reader yields blocks for the layers it keeps"
        # Blocks on every device: the loaders shard them first, and the form turns this rank's
        # rows into integers where its kernels need those (`QuantizedLinear`).
        return weight


def _is_projection(hf_name: str) -> bool:
    parts = hf_name.rsplit(".", 2)
    return len(parts) == 3 and parts[1] in _PROJECTIONS and parts[2] == "weight"


def _file_bits(ggml_type: int) -> float:
    block_len, block_bytes = block_size(ggml_type)
    return 8 * block_bytes / block_len


def _has_kernel(ggml_type: int | None) -> bool:
    if ggml_type is None:
        return False
    from ferrollm.kernels.cpu.gguf import gguf_linear_supported

    return gguf_linear_supported(ggml_type)
