"""Reading checkpoints: HF safetensors folders and llama.cpp GGUF files, as ``(hf_name, tensor)``
streams a model's ``load_weights`` consumes one tensor at a time (peak memory stays near one
model's worth).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.exceptions import CheckpointError, UnsupportedModelError
from ferrollm.model_executor.layers.cpu_gemm import onednn_enabled, pack_linear_weights
from ferrollm.model_executor.registry import ModelRegistry
from ferrollm.model_executor.weight_utils import LazyTensor, shareable

__all__ = ["build_model", "get_model", "gguf_to_hf_name", "iterate_safetensors", "load_gguf", "load_model"]

LOAD_FORMATS = ("auto", "safetensors", "gguf", "sharded_state")

SAFETENSORS_INDEX = "model.safetensors.index.json"


def iterate_safetensors(folder: str | Path, lazy: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields every tensor of a safetensors checkpoint folder.

    Args:
        folder: holds ``model.safetensors``, or shards listed in ``model.safetensors.index.json``
            (any other ``*.safetensors`` files are read when there is neither).
        lazy: yield :class:`LazyTensor` windows instead, read when a weight loader copies its
            slice (a tensor-parallel rank then reads only what it keeps).

    Yields:
        ``(name, tensor)`` with the checkpoint's names and dtypes. The tensors are views of the
        file's private, copy-on-write mapping, marked :func:`shareable`: parameters filled whole
        from them keep the mapping instead of a copy.

    Raises:
        CheckpointError: if the folder has no safetensors files.
    """
    from safetensors import safe_open

    folder = Path(folder)
    for path in _safetensors_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if lazy:
                    handle = f.get_slice(name)
                    yield name, LazyTensor(handle, tuple(handle.get_shape()))  # type: ignore[misc]
                else:
                    yield name, shareable(f.get_tensor(name))


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [folder / name for name in sorted(set(weight_map.values()))]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {str(folder)!r}")
    return files


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


def get_model(
    config: PretrainedConfig,
    dtype: torch.dtype,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str = "cpu",
) -> nn.Module:
    """Builds the model ``config.architectures`` names and loads the checkpoint into it.

    Args:
        config: the HF config (after ``hf_overrides``).
        dtype: parameter dtype.
        weights: ``(hf_name, tensor)`` pairs, from :func:`iterate_safetensors` or :func:`load_gguf`.
        device: where to build the model.

    Returns:
        The model, in eval mode.

    Raises:
        UnsupportedModelError: for an architecture the registry does not know.
        CheckpointError: for tensors that do not match the model.
    """
    model = build_model(config, dtype, device)
    model.load_weights(weights)
    return finish_loading(model, dtype, device)


def build_model(config: PretrainedConfig, dtype: torch.dtype, device: torch.device | str = "cpu") -> nn.Module:
    """The model ``config.architectures`` names, sharded for this rank, weights not loaded.

    Raises:
        UnsupportedModelError: for an architecture the registry does not know.
    """
    model_cls = ModelRegistry.resolve(list(getattr(config, "architectures", None) or []))
    with torch.device(device):
        return model_cls(config, dtype)


def finish_loading(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Packs the loaded weights for oneDNN where that applies; returns the model in eval mode."""
    if onednn_enabled(torch.device(device), dtype):
        pack_linear_weights(model)
    return model.eval()


def load_model(model_config, load_format: str, device: torch.device, rank: int = 0,
               world_size: int = 1) -> nn.Module:
    """Builds this rank's shard of the model and loads its weights.

    Args:
        model_config: a `ModelConfig`.
        load_format: ``"auto"`` (the checkpoint's own format), ``"safetensors"``, ``"gguf"`` or
            ``"sharded_state"`` (per-rank files written by ``LLM.save_sharded_state``).
        device: where to build the model.
        rank, world_size: this tensor-parallel rank and the TP size.

    Raises:
        CheckpointError: for missing, unexpected or mis-shaped tensors, or sharded files written
            for another TP size.
    """
    from ferrollm.model_executor.sharded_state import load_rank_state

    source, dtype = model_config.source, model_config.dtype
    if load_format == "sharded_state":
        model = build_model(model_config.hf_config, dtype, device)
        load_rank_state(model, source.folder, rank, world_size)
        return finish_loading(model, dtype, device)
    if source.gguf_file is not None:
        _, weights = load_gguf(source.gguf_file)
    else:
        # Under TP each rank reads only the slices its layers keep.
        weights = iterate_safetensors(source.folder, lazy=world_size > 1)
    return get_model(model_config.hf_config, dtype, weights, device=device)
