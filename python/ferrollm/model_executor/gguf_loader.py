"""Reading llama.cpp GGUF files: the HF config the file describes and a stream of HF-named
tensors, in the order ``load_weights`` consumes them.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig

from ferrollm.exceptions import CheckpointError, UnsupportedModelError
from ferrollm.model_executor.registry import ModelRegistry
from ferrollm.model_executor.weight_utils import shareable

__all__ = ["gguf_to_hf_name", "load_gguf"]


def load_gguf(path: str | Path) -> tuple[PretrainedConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Opens a llama.cpp GGUF file as an HF config and a stream of HF-named float tensors.

    The config comes from transformers' own GGUF metadata parsing, so it is the one
    ``from_pretrained(..., gguf_file=...)`` would build. Quantized tensors are dequantized to
    float32. llama.cpp stores Llama's q/k projection rows interleaved per head for its rotary
    kernel; they are put back in HF's half-split order.

    Args:
        path: the ``.gguf`` file.

    Returns:
        ``(config, weights)``; ``weights`` reads the file lazily as it is iterated.

    Raises:
        CheckpointError: if the file does not exist.
        UnsupportedModelError: if transformers knows no causal-LM class for the file's model type.
    """
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    if not getattr(config, "architectures", None):
        # GGUF metadata names a model type, not a class; take the causal-LM class HF maps it to.
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if arch is None:
            raise UnsupportedModelError(
                f"GGUF model type {config.model_type!r} has no causal-LM architecture; supported "
                f"architectures: {ModelRegistry.get_supported_archs()}"
            )
        config.architectures = [arch]
    return config, _iterate_gguf(path, config)


# llama.cpp's per-layer tensor names -> HF's (Llama-style architectures).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp derives from the config (Llama 3's rope_freqs); the model recomputes them.
_GGUF_SKIPPED = {"rope_freqs"}
# GGUF architectures whose q/k rows llama.cpp's converter permuted.
_GGUF_PERMUTED_ARCHS = {"llama"}


def gguf_to_hf_name(name: str) -> str | None:
    """HF name of a llama.cpp tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3.
    self_attn.q_proj.weight``), or ``None`` for tensors HF models do not have."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GGUF_SKIPPED:
        return None
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    raise CheckpointError(f"GGUF tensor {name!r} has no known HF name")


def _iterate_gguf(path: Path, config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents())
    for tensor in reader.tensors:
        hf_name = gguf_to_hf_name(tensor.name)
        if hf_name is None:
            continue
        array = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        # Unquantized tensors come back as read-only views of the memory-mapped file.
        array = np.asarray(array, dtype=np.float32)
        if not array.flags.writeable:
            array = array.copy()
        weight = shareable(torch.from_numpy(array))
        if arch in _GGUF_PERMUTED_ARCHS:
            weight = _unpermute_qk(tensor.name, weight, config)
        yield hf_name, weight


def _unpermute_qk(name: str, weight: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    """Undoes llama.cpp's q/k row order: within each head it stores rows as interleaved pairs
    (first-half row i, second-half row i) where HF keeps the two halves apart."""
    if ".attn_q." in name:
        num_heads = config.num_attention_heads
    elif ".attn_k." in name:
        num_heads = config.num_key_value_heads
    else:
        return weight
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape).contiguous()
