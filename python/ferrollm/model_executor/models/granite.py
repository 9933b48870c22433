"""Granite (IBM Granite 3): Llama's layout with four scalars from the config: the embeddings are
multiplied by ``embedding_multiplier``, attention scores by ``attention_multiplier`` (in place of
``head_dim ** -0.5``), each block's output by ``residual_multiplier`` before it joins the residual,
and the logits are divided by ``logits_scaling``."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PretrainedConfig

from ferrollm.model_executor.models.llama import LayerOptions, LlamaForCausalLM

__all__ = ["GraniteForCausalLM"]


class GraniteForCausalLM(LlamaForCausalLM):
    """Granite decoder with an LM head.

    Args:
        config: the HF ``GraniteConfig``.
        dtype: parameter and activation dtype.
    """

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__(config, dtype)
        self.logits_scaling = float(getattr(config, "logits_scaling", 1.0))

    @classmethod
    def layer_options(cls, config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        return replace(super().layer_options(config, layer_idx),
                       scale=float(config.attention_multiplier),
                       residual_multiplier=float(config.residual_multiplier))

    @classmethod
    def embedding_scale(cls, config: PretrainedConfig, dtype: torch.dtype) -> float | None:
        return float(config.embedding_multiplier)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 ``[num_rows, vocab_size]`` logits, divided by ``logits_scaling``."""
        return super().compute_logits(hidden_states) / self.logits_scaling
