"""`load_format="dummy"`: random weights of the checkpoint's shapes, for benchmarks, with no
weight files read (only config.json).

The names and shapes come from transformers' own model for the config, built on the meta device
(no memory, ~0.1 s); each tensor is filled uniformly in [-1e-3, 1e-3] as vLLM's dummy loader
does, from a fixed seed so two engines get the same weights. The stream goes through the
model's `load_weights` like a checkpoint's, so sharding and online quantization apply as usual.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ferrollm.exceptions import ConfigError

DUMMY_RANGE = 1e-3


def check_dummy_source(hf_config: Any, is_gguf: bool) -> None:
    """Dummy weights are float tensors: a checkpoint whose layers expect packed (quantized)
    tensors cannot take them.

    Raises:
        ConfigError: for a GGUF file or a checkpoint with a `quantization_config`.
    """
    if is_gguf or getattr(hf_config, "quantization_config", None) is not None:
        kind = "a GGUF file" if is_gguf else "a quantized checkpoint (quantization_config in config.json)"
        raise ConfigError(f"`load_format='dummy'` makes float weights, so it cannot stand in for {kind}: use a "
                          "float checkpoint's config.json (with `quantization=` for online quantization)")


def dummy_weights(hf_config: Any, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields ``(hf_name, tensor)`` for every parameter of the config's architecture."""
    generator = torch.Generator().manual_seed(seed)
    for name, shape in _hf_shapes(hf_config):
        tensor = torch.empty(shape, dtype=torch.float32)
        tensor.uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=generator)
        yield name, tensor


def _hf_shapes(hf_config: Any) -> list[tuple[str, torch.Size]]:
    import transformers

    architectures = list(getattr(hf_config, "architectures", None) or [])
    cls = next((getattr(transformers, a) for a in architectures if hasattr(transformers, a)), None)
    if cls is None:
        raise ConfigError(f"`load_format='dummy'` needs an architecture transformers knows. Given: {architectures}")
    with torch.device("meta"):
        model = cls(hf_config)
    return [(name, p.shape) for name, p in model.named_parameters()]
