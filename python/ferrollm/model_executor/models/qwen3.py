"""Qwen3: Qwen2's layout without q/k/v biases, with an RMSNorm over each q and k head before the
rotary embedding, and ``head_dim`` from the config."""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from ferrollm.model_executor.models.llama import LayerOptions, LlamaForCausalLM
from ferrollm.model_executor.models.qwen2 import qwen_sliding_window

__all__ = ["Qwen3ForCausalLM"]


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 (dense) decoder with an LM head.

    Args:
        config: the HF ``Qwen3Config``; ``attention_bias`` adds biases to q, k, v and o alike.
        dtype: parameter and activation dtype.
    """

    @classmethod
    def layer_options(cls, config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        return replace(super().layer_options(config, layer_idx), qk_norm=True,
                       sliding_window=qwen_sliding_window(config, layer_idx))
