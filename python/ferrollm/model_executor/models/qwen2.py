"""Qwen2: Llama's layout with biases on q/k/v and optional per-layer sliding windows."""

from __future__ import annotations

from transformers import PretrainedConfig

from ferrollm.model_executor.models.llama import LlamaForCausalLM

__all__ = ["Qwen2ForCausalLM"]


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 decoder with an LM head (tied to the embedding when ``tie_word_embeddings``).

    Args:
        config: the HF ``Qwen2Config``.
        dtype: parameter and activation dtype.
    """

    @staticmethod
    def _qkv_bias(config: PretrainedConfig) -> bool:
        return True

    @staticmethod
    def _sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
        # Recent configs list each layer's type; older ones only say which layers use windows.
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            is_sliding = layer_types[layer_idx] == "sliding_attention"
        else:
            is_sliding = (getattr(config, "use_sliding_window", False)
                          and layer_idx >= getattr(config, "max_window_layers", 0))
        return config.sliding_window if is_sliding else None
