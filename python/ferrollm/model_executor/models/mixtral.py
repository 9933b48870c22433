"""Mixtral: Llama's attention and norms with a routed mixture of experts in place of the MLP.

Router: softmax over the experts, top-k, weights renormalised to sum to 1. The experts run
through :class:`FusedMoE` (weights stacked per layer, tokens grouped by expert). Checkpoints name
the block ``block_sparse_moe`` and the experts' projections ``w1`` (gate), ``w3`` (up), ``w2``
(down); like transformers 5, the model calls the block ``mlp``. Qwen2-MoE subclasses this model
through the ``_mlp``/``_qkv_bias``/``_sliding_window`` hooks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.exceptions import UnsupportedModelError
from ferrollm.model_executor.layers.fused_moe import (
    FusedMoE,
    expert_params_mapping,
    unstack_expert_weights,
)
from ferrollm.model_executor.layers.linear import ReplicatedLinear
from ferrollm.model_executor.layers.norm import RMSNorm
from ferrollm.model_executor.layers.rotary import RotaryEmbedding, get_rope, rope_max_position, rope_parameters
from ferrollm.model_executor.layers.vocab import ParallelLMHead
from ferrollm.model_executor.models.llama import LayerOptions, LlamaAttention, LlamaForCausalLM, LlamaModel
from ferrollm.model_executor.models.utils import CausalLMInterface, load_weights_into

__all__ = ["MixtralForCausalLM", "MoEDecoderLayer"]


def check_silu(config: PretrainedConfig) -> None:
    """The experts' kernel is ``silu(gate) * up``; other activations are refused."""
    if config.hidden_act != "silu":
        raise UnsupportedModelError(
            f"hidden_act {config.hidden_act!r} is not supported for mixture-of-experts; only 'silu'"
        )


class MixtralMoE(nn.Module):
    """Router and experts of one Mixtral layer."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        check_silu(config)
        num_experts = config.num_local_experts
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False, params_dtype=dtype)
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.intermediate_size, renormalize=True, params_dtype=dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.experts(hidden_states, self.gate(hidden_states))


class MoEDecoderLayer(nn.Module):
    """Llama's pre-norm block around any MLP (a routed block, or a dense one in mixed stacks).

    Args:
        config: the HF config.
        dtype: parameter dtype.
        mlp: the feed-forward module, called on ``[num_tokens, hidden]``.
        qkv_bias: whether q/k/v have biases.
        sliding_window: this layer's attention window, or ``None``.
        rotary_emb: the rotary embedding, shared by the layers.
    """

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, mlp: nn.Module,
                 qkv_bias: bool, sliding_window: int | None, rotary_emb: RotaryEmbedding):
        super().__init__()
        opts = LayerOptions(rope=rope_parameters(config), qkv_bias=qkv_bias, sliding_window=sliding_window)
        self.self_attn = LlamaAttention(config, dtype, opts, rotary_emb)
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, positions, hidden_states, residual, kv_cache, attn_metadata):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class MixtralForCausalLM(CausalLMInterface, nn.Module):
    """Mixtral decoder with an LM head.

    Args:
        config: the HF ``MixtralConfig``.
        dtype: parameter and activation dtype.
    """

    # The checkpoint's (gate, up, down) names of one expert's projections.
    expert_names: tuple[str, str, str] = ("w1", "w3", "w2")
    # Checkpoint name fragments and what the model calls them.
    checkpoint_renames: tuple[tuple[str, str], ...] = ((".block_sparse_moe.", ".mlp."),)

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        rope = get_rope(self.head_dim, rope_max_position(config), rope_parameters(config), dtype=dtype)
        self.sliding_windows = [self._sliding_window(config, i) for i in range(self.num_layers)]
        layers = [MoEDecoderLayer(config, dtype, self._mlp(config, dtype, i), self._qkv_bias(config),
                                  self.sliding_windows[i], rope)
                  for i in range(self.num_layers)]
        self.model = LlamaModel(config, dtype, layers, RMSNorm(config.hidden_size, config.rms_norm_eps, dtype))
        self.num_kv_heads = layers[0].self_attn.qkv_proj.num_kv_heads if layers else 0
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)
        # Expert entries first: Qwen2-MoE's `.experts.0.gate_proj` also contains `.gate_proj`.
        self.stacked_params_mapping = (
            expert_params_mapping(self._num_experts(config), *self.expert_names)
            + LlamaForCausalLM.stacked_params_mapping
        )

    @staticmethod
    def _num_experts(config: PretrainedConfig) -> int:
        return config.num_local_experts

    @staticmethod
    def _mlp(config: PretrainedConfig, dtype: torch.dtype, layer_idx: int) -> nn.Module:
        return MixtralMoE(config, dtype)

    @staticmethod
    def _qkv_bias(config: PretrainedConfig) -> bool:
        return False

    @staticmethod
    def _sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
        return getattr(config, "sliding_window", None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Runs one step; same contract as :meth:`LlamaForCausalLM.forward`."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads an HF checkpoint's tensors by name, experts saved per expert or stacked.

        Args:
            weights: ``(hf_name, tensor)`` pairs.

        Returns:
            The parameter names loaded.

        Raises:
            CheckpointError: for unknown, missing or mis-shaped tensors.
        """
        renamed = ((self._rename(name), tensor) for name, tensor in weights)
        per_expert = unstack_expert_weights(renamed, *self.expert_names)
        skip: tuple[str, ...] = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            skip += ("lm_head.",)
        return load_weights_into(self, per_expert, self.stacked_params_mapping, skip)

    def _rename(self, name: str) -> str:
        for old, new in self.checkpoint_renames:
            name = name.replace(old, new)
        return name
