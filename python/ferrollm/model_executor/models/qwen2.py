"""Qwen2: Llama's layout with biases on q/k/v and optional per-layer sliding windows."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from ferrollm.model_executor.models.llama import LayerOptions, LlamaForCausalLM
from ferrollm.model_executor.models.utils import layer_sliding_window

__all__ = ["Qwen2ForCausalLM"]


def qwen_sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
    """Qwen2/Qwen3's window of one layer: configs list each layer's type; older ones only say
    that layers from ``max_window_layers`` on slide when ``use_sliding_window``."""
    slides = (bool(getattr(config, "use_sliding_window", False))
              and layer_idx >= getattr(config, "max_window_layers", 0))
    return layer_sliding_window(config, layer_idx, slides)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 decoder with an LM head (tied to the embedding when ``tie_word_embeddings``).

    Args:
        config: the HF ``Qwen2Config``.
        dtype: parameter and activation dtype.
    """

    @classmethod
    def layer_options(cls, config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        return replace(super().layer_options(config, layer_idx), qkv_bias=True, o_bias=False,
                       sliding_window=qwen_sliding_window(config, layer_idx))
