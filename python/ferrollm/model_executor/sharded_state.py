"""Per-rank checkpoints (``load_format="sharded_state"``): each tensor-parallel rank writes the
parameters it holds, already sharded and padded, to ``model-rank-{rank}-part-{part}.safetensors``,
and loads back only its own files, copying them into its parameters without any slicing. Loading
time then stays flat as the TP size grows: every rank reads 1/N of the weights, in parallel.

The files record the TP size they were written for; loading them at another size is refused
with both sizes named.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ferrollm.exceptions import CheckpointError, ConfigError

__all__ = ["DEFAULT_PATTERN", "copy_non_weight_files", "dense_state_dict", "load_rank_state", "save_rank_state",
           "saved_tensor_parallel_size"]

# Weight files of the source checkpoint, which the sharded files replace.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".safetensors.index.json", ".bin.index.json")

DEFAULT_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
_TP_KEY = "tensor_parallel_size"


def dense_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters by name, a tensor shared by several names (tied embeddings) kept once; a layer
    whose weight lives in a CPU form (`cpu_weights`) gives it back in the plain layout, and a
    quantized one its quantized tensors (`quantization.saved_state`)."""
    dense = {f"{prefix}.weight" if prefix else "weight": module.dense_weight
             for prefix, module in model.named_modules() if callable(getattr(module, "dense_weight", None))}
    seen: set[int] = set()
    out = {}
    for prefix, module in model.named_modules():
        state = module.quantized_state() if callable(getattr(module, "quantized_state", None)) else None
        if state is not None:
            out.update({f"{prefix}.{name}": tensor for name, tensor in state.items()})
            dense.pop(f"{prefix}.weight", None)
            seen.add(id(getattr(module, "weight", None)))
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            continue
        seen.add(id(param))
        out[name] = dense[name]().detach() if name in dense else param.detach()
    return out


def save_rank_state(model: nn.Module, path: str | Path, rank: int, pattern: str | None = None,
                    max_size: int | None = None) -> list[str]:
    """Writes this rank's parameters to ``path``.

    Args:
        model: this rank's model.
        path: the folder (created if needed).
        rank: this rank.
        pattern: file name with ``{rank}`` and ``{part}`` fields (default
            ``model-rank-{rank}-part-{part}.safetensors``).
        max_size: start a new part once a file would exceed this many bytes (None: one file).

    Returns:
        The file names written.
    """
    from safetensors.torch import save_file

    from ferrollm.distributed import get_tensor_model_parallel_world_size

    pattern = pattern or DEFAULT_PATTERN
    if max_size is not None and max_size < 1:
        raise ConfigError(f"`max_size` must be >= 1 byte. Given: {max_size}")
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in dense_state_dict(model).items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_size is not None and parts[-1] and size + nbytes > max_size:
            parts.append({})
            size = 0
        parts[-1][name] = tensor.contiguous().cpu()
        size += nbytes
    metadata = {_TP_KEY: str(get_tensor_model_parallel_world_size()), "rank": str(rank)}
    names = []
    for part, tensors in enumerate(parts):
        name = pattern.format(rank=rank, part=part)
        save_file(tensors, str(folder / name), metadata=metadata)
        names.append(name)
    return names


def _glob(pattern: str, rank: str) -> str:
    return pattern.format(rank=rank, part="*")


def _rank_files(folder: Path, pattern: str) -> dict[int, list[Path]]:
    """The sharded files in ``folder``, by rank."""
    regex = re.compile(re.escape(pattern).replace(r"\{rank\}", r"(\d+)").replace(r"\{part\}", r"(\d+)") + "$")
    by_rank: dict[int, list[Path]] = {}
    for f in folder.glob(_glob(pattern, "*")):
        m = regex.match(f.name)
        if m:
            by_rank.setdefault(int(m.group(1)), []).append(f)
    return {r: sorted(files, key=lambda p: int(regex.match(p.name).group(2))) for r, files in by_rank.items()}  # type: ignore[union-attr]


def saved_tensor_parallel_size(folder: str | Path, pattern: str | None = None) -> int:
    """The TP size the sharded files in ``folder`` were written for.

    Raises:
        CheckpointError: if there are none.
    """
    from safetensors import safe_open

    files = _rank_files(Path(folder), pattern or DEFAULT_PATTERN)
    if not files:
        raise CheckpointError(
            f"load_format='sharded_state' needs files named like {DEFAULT_PATTERN!r} in {str(folder)!r} "
            "(written by LLM.save_sharded_state); found none")
    with safe_open(str(files[min(files)][0]), framework="pt") as f:
        recorded = (f.metadata() or {}).get(_TP_KEY)
    return int(recorded) if recorded is not None else max(files) + 1


def load_rank_state(model: nn.Module, folder: str | Path, rank: int, world_size: int,
                    pattern: str | None = None) -> None:
    """Copies this rank's files into the model's parameters.

    Raises:
        CheckpointError: if the files were written for another TP size (naming both), or a
            tensor is missing, unexpected or mis-shaped.
    """
    from safetensors import safe_open

    folder = Path(folder)
    saved = saved_tensor_parallel_size(folder, pattern)
    if saved != world_size:
        raise CheckpointError(
            f"the sharded checkpoint in {str(folder)!r} was saved with tensor_parallel_size={saved}, "
            f"but this engine runs tensor_parallel_size={world_size}; load it with "
            f"tensor_parallel_size={saved}, or save it again at {world_size}")
    params = dense_state_dict(model)
    # A quantized layer's placeholders (`LinearBase.set_quant_method`) take their tensors through
    # their own loader (the state dict holds detached views of them).
    pieces = {n: p for n, p in model.named_parameters() if getattr(p, "quant_piece", False)}
    loaded: set[str] = set()
    for path in _rank_files(folder, pattern or DEFAULT_PATTERN).get(rank, []):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                param = params.get(name)
                if param is None:
                    raise CheckpointError(f"{path.name}: tensor {name!r} has no parameter in {type(model).__name__}")
                tensor = f.get_tensor(name)
                if name in pieces:
                    pieces[name].weight_loader(pieces[name], tensor)
                    loaded.add(name)
                    continue
                if tuple(tensor.shape) != tuple(param.shape):
                    raise CheckpointError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                          f"the model expects {tuple(param.shape)}")
                with torch.no_grad():
                    param.copy_(tensor)
                loaded.add(name)
    missing = sorted(n for n in set(params) - loaded if not getattr(pieces.get(n), "optional", False))
    if missing:
        raise CheckpointError(f"rank {rank}'s sharded files lack {len(missing)} tensors, e.g. {missing[:5]}")


def copy_non_weight_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copies everything in ``src`` but the weights (config, tokenizer, generation config...)
    into ``dst``; returns the names copied."""
    import shutil

    src, dst = Path(src), Path(dst)
    if src.resolve() == dst.resolve():
        return []
    copied = []
    for item in sorted(src.iterdir()):
        if item.name.endswith(_WEIGHT_SUFFIXES):
            continue
        if item.is_dir():
            shutil.copytree(item, dst / item.name, dirs_exist_ok=True)
        else:
            shutil.copy2(item, dst / item.name)
        copied.append(item.name)
    return copied
