"""`VllmConfig`: the engine's configuration as one object, under vLLM's name, for code written
against vLLM that takes one (custom logits processors' constructors)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["VllmConfig"]


@dataclass
class VllmConfig:
    """The engine's configuration.

    Args:
        model_config: The model's `ModelConfig` (`hf_config`, `max_model_len`, `dtype`, ...).
        engine_args: The `EngineArgs` the engine was built from.
    """

    model_config: Any = None
    engine_args: Any = None
