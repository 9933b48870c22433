"""Building a model and loading its checkpoint: HF safetensors folders (read here), llama.cpp GGUF
files (`gguf_loader`) and per-rank sharded state (`sharded_state`), as ``(hf_name, tensor)``
streams a model's ``load_weights`` consumes one tensor at a time.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.layers.cpu_weights import cpu_weight_form
from ferrollm.model_executor.layers.quantization import QuantizationConfig, attach_quant_methods, log_quantized_bytes
from ferrollm.model_executor.layers.rotary import MAX_MODEL_LEN_ATTR
from ferrollm.model_executor.gguf_loader import gguf_to_hf_name, load_gguf
from ferrollm.model_executor.registry import ModelRegistry
from ferrollm.model_executor.weight_utils import LazyTensor, file_mapped

__all__ = ["build_model", "get_model", "gguf_to_hf_name", "iterate_safetensors", "load_gguf", "load_model"]

LOAD_FORMATS = ("auto", "safetensors", "gguf", "sharded_state", "dummy")

SAFETENSORS_INDEX = "model.safetensors.index.json"


def iterate_safetensors(folder: str | Path, lazy: bool = False,
                        progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields every tensor of a safetensors checkpoint folder.

    Args:
        folder: holds ``model.safetensors``, or shards listed in ``model.safetensors.index.json``
            (any other ``*.safetensors`` files are read when there is neither).
        lazy: yield :class:`LazyTensor` windows instead, read when a weight loader copies its
            slice (a tensor-parallel rank then reads only what it keeps).
        progress: show a progress bar over the files (vLLM's `use_tqdm_on_load`).

    Yields:
        ``(name, tensor)`` with the checkpoint's names and dtypes. The tensors are views of the
        file's private, copy-on-write mapping, marked `file_mapped`: layers keep the mapping (or
        views of it) instead of a copy where they can.

    Raises:
        CheckpointError: if the folder has no safetensors files.
    """
    from safetensors import safe_open

    from tqdm.auto import tqdm

    folder = Path(folder)
    files = _safetensors_files(folder)
    for path in tqdm(files, desc="Loading safetensors checkpoint shards", disable=not progress):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                if lazy:
                    handle = f.get_slice(name)
                    yield name, LazyTensor(handle, tuple(handle.get_shape()))  # type: ignore[misc]
                else:
                    yield name, file_mapped(f.get_tensor(name))


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


def get_model(
    config: PretrainedConfig,
    dtype: torch.dtype,
    weights: Iterable[tuple[str, torch.Tensor]],
    device: torch.device | str = "cpu",
    quant_config: QuantizationConfig | None = None,
) -> nn.Module:
    """Builds the model ``config.architectures`` names and loads the checkpoint into it.

    Args:
        config: the HF config (after ``hf_overrides``).
        dtype: parameter dtype.
        weights: ``(hf_name, tensor)`` pairs, from :func:`iterate_safetensors` or :func:`load_gguf`.
        device: where to build the model.
        quant_config: the model's quantization (`resolve_quantization`), or None.

    Returns:
        The model, in eval mode.

    Raises:
        UnsupportedModelError: for an architecture the registry does not know.
        CheckpointError: for tensors that do not match the model.
    """
    model = build_model(config, dtype, device)
    begin_loading(model, dtype, device, quant_config)
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


def begin_loading(model: nn.Module, dtype: torch.dtype, device: torch.device | str,
                  quant_config: QuantizationConfig | None = None) -> None:
    """Makes the CPU layers collect their checkpoint rows straight into the one form they keep
    (see `cpu_weights`), so no merged or dense copy is made on the way; quantized layers take
    their method's checkpoint tensors first."""
    if quant_config is not None:
        attach_quant_methods(model, quant_config, torch.device(device))
    form = cpu_weight_form(torch.device(device), dtype)
    for module in model.modules():
        begin = getattr(module, "begin_cpu_weight", None)
        if callable(begin):
            begin(form)


def finish_loading(model: nn.Module, dtype: torch.dtype, device: torch.device | str) -> nn.Module:
    """Builds the CPU form of every layer the loading did not (LM heads, sharded state); returns
    the model in eval mode."""
    form = cpu_weight_form(torch.device(device), dtype)
    for module in model.modules():
        finish = getattr(module, "finish_cpu_weight", None)
        if callable(finish):
            finish(form)
    log_quantized_bytes(model, dtype)
    return model.eval()


def load_model(model_config, load_format: str, device: torch.device, rank: int = 0,
               world_size: int = 1, progress: bool = False) -> nn.Module:
    """Builds this rank's shard of the model and loads its weights.

    Args:
        model_config: a `ModelConfig`.
        load_format: ``"auto"`` (the checkpoint's own format), ``"safetensors"``, ``"gguf"``,
            ``"sharded_state"`` (per-rank files written by ``LLM.save_sharded_state``) or
            ``"dummy"`` (random weights, `dummy_weights`).
        device: where to build the model.
        rank, world_size: this tensor-parallel rank and the TP size.
        progress: show a progress bar over the safetensors files.

    Raises:
        CheckpointError: for missing, unexpected or mis-shaped tensors, or sharded files written
            for another TP size.
    """
    from ferrollm.model_executor.sharded_state import load_rank_state

    source, dtype = model_config.source, model_config.dtype
    # No position past `max_model_len` ever runs: tables sized by position stop there.
    setattr(model_config.hf_config, MAX_MODEL_LEN_ATTR, model_config.max_model_len)
    quant_config = model_config.quant_config
    if load_format == "sharded_state":
        model = build_model(model_config.hf_config, dtype, device)
        if quant_config is not None:
            from ferrollm.model_executor.layers.quantization.saved_state import SavedStateConfig

            begin_loading(model, dtype, device, SavedStateConfig(quant_config))
        load_rank_state(model, source.folder, rank, world_size)
        return finish_loading(model, dtype, device)
    if load_format == "dummy":
        from ferrollm.model_executor.dummy_weights import dummy_weights

        weights = dummy_weights(model_config.hf_config)
    elif source.gguf_file is not None:
        _, weights = load_gguf(source.gguf_file, quant_config, device)
    else:
        # Under TP each rank reads only the slices its layers keep: on the CPU they are views of
        # the mapping (whose pages the ranks share), elsewhere windows read when copied.
        weights = iterate_safetensors(source.folder, lazy=world_size > 1 and device.type != "cpu", progress=progress)
    return get_model(model_config.hf_config, dtype, weights, device=device, quant_config=quant_config)
