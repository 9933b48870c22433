"""Gemma (v1): Llama's block with Gemma's RMSNorm (``1 + weight``), a GeGLU MLP (tanh-approximated
GELU), embeddings scaled by ``sqrt(hidden_size)`` and the LM head tied to the embedding."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PretrainedConfig

from ferrollm.model_executor.layers.norm import GemmaRMSNorm
from ferrollm.model_executor.models.llama import LayerOptions, LlamaForCausalLM

__all__ = ["GemmaForCausalLM", "gemma_embedding_scale"]


def gemma_embedding_scale(config: PretrainedConfig, dtype: torch.dtype) -> float:
    """``sqrt(hidden_size)`` rounded to the model dtype, as Gemma's reference does (in bfloat16
    sqrt(3072) = 55.43 becomes 55.5)."""
    return float(torch.tensor(config.hidden_size**0.5, dtype=dtype))


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma decoder with an LM head.

    Args:
        config: the HF ``GemmaConfig``. The activation is ``hidden_activation`` when set, else
            ``hidden_act``; the legacy ``"gelu"`` of the original releases means the tanh
            approximation, as in transformers.
        dtype: parameter and activation dtype.
    """

    norm_cls = GemmaRMSNorm

    @classmethod
    def layer_options(cls, config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        act = getattr(config, "hidden_activation", None) or config.hidden_act
        if act == "gelu":
            act = "gelu_pytorch_tanh"
        return replace(super().layer_options(config, layer_idx), hidden_act=act)

    @classmethod
    def embedding_scale(cls, config: PretrainedConfig, dtype: torch.dtype) -> float | None:
        return gemma_embedding_scale(config, dtype)
