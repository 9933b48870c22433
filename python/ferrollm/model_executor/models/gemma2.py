"""Gemma 2: Gemma with a norm after attention and around the MLP ("sandwich" norms), attention
scores scaled by ``query_pre_attn_scalar ** -0.5`` and soft-capped at ``attn_logit_softcapping``,
sliding-window and global layers as ``layer_types`` says (alternating, sliding first, in older
configs), and final logits soft-capped at ``final_logit_softcapping``."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PretrainedConfig

from ferrollm.exceptions import UnsupportedModelError
from ferrollm.model_executor.layers.norm import GemmaRMSNorm
from ferrollm.model_executor.layers.rotary import RotaryEmbedding
from ferrollm.model_executor.models.gemma import gemma_embedding_scale
from ferrollm.model_executor.models.llama import LayerOptions, LlamaDecoderLayer, LlamaForCausalLM
from ferrollm.model_executor.models.utils import layer_sliding_window

__all__ = ["Gemma2DecoderLayer", "Gemma2ForCausalLM", "check_causal", "gemma2_activation", "soft_cap"]


def soft_cap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """``cap * tanh(x / cap)``, or ``x`` when ``cap`` is ``None``."""
    return x if cap is None else cap * torch.tanh(x / cap)


class Gemma2DecoderLayer(LlamaDecoderLayer):
    """Llama's block plus a norm on the attention output and on both sides of the MLP.

    The residual stream still travels separately: ``input_layernorm`` and
    ``pre_feedforward_layernorm`` fuse the adds, the post-norms act on the block outputs alone.
    """

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, opts: LayerOptions,
                 rotary_emb: RotaryEmbedding):
        super().__init__(config, dtype, opts, rotary_emb)
        self.pre_feedforward_layernorm = opts.norm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_feedforward_layernorm = opts.norm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, hidden_states, residual, kv_cache, attn_metadata):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        hidden_states = self.post_feedforward_layernorm(self.mlp(hidden_states))
        return hidden_states, residual


def gemma2_activation(config: PretrainedConfig) -> str:
    """Gemma 2/3's MLP activation: ``hidden_activation`` (taken literally, as transformers does)."""
    return (getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
            or "gelu_pytorch_tanh")


def check_causal(config: PretrainedConfig) -> None:
    """Raises for the bidirectional (embedding-model) variant of a Gemma config."""
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedModelError(
            "use_bidirectional_attention=True is not supported; ferrollm runs causal decoders only"
        )


class Gemma2ForCausalLM(LlamaForCausalLM):
    """Gemma 2 decoder with an LM head tied to the embedding.

    Args:
        config: the HF ``Gemma2Config``.
        dtype: parameter and activation dtype.

    Raises:
        UnsupportedModelError: for ``use_bidirectional_attention``.
    """

    decoder_layer_cls = Gemma2DecoderLayer
    norm_cls = GemmaRMSNorm

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        check_causal(config)
        super().__init__(config, dtype)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)

    @classmethod
    def layer_options(cls, config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        # Older configs without layer_types: even layers slide, odd ones are global.
        window = layer_sliding_window(config, layer_idx, layer_idx % 2 == 0)
        return replace(super().layer_options(config, layer_idx),
                       hidden_act=gemma2_activation(config),
                       scale=config.query_pre_attn_scalar**-0.5,
                       sliding_window=window,
                       logits_soft_cap=getattr(config, "attn_logit_softcapping", None))

    @classmethod
    def embedding_scale(cls, config: PretrainedConfig, dtype: torch.dtype) -> float | None:
        return gemma_embedding_scale(config, dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 ``[num_rows, vocab_size]`` logits, soft-capped at ``final_logit_softcapping``."""
        return soft_cap(super().compute_logits(hidden_states), self.final_logit_softcapping)
