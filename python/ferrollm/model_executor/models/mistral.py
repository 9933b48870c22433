"""Mistral: Llama's layout; every layer slides when ``sliding_window`` is set (Mistral 7B v0.1)."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from ferrollm.model_executor.models.llama import LayerOptions, LlamaForCausalLM

__all__ = ["MistralForCausalLM"]


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral decoder with an LM head.

    Args:
        config: the HF ``MistralConfig``; ``sliding_window`` (``None`` for v0.2 on) applies to
            every layer, as in transformers, which ignores ``layer_types`` for Mistral.
        dtype: parameter and activation dtype.
    """

    @classmethod
    def layer_options(cls, config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        return replace(super().layer_options(config, layer_idx),
                       sliding_window=getattr(config, "sliding_window", None))
