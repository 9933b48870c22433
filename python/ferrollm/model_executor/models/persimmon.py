"""Persimmon (adept/persimmon-8b) on the paged-attention interface, and the decoder of Fuyu.

Pre-LayerNorm blocks with a sequential residual; multi-head attention whose fused
``query_key_value`` is stored per head (``[q_h, k_h, v_h]`` for each head ``h``, as GPT-NeoX
stores it: ``load_weights`` regroups it into ``[q; k; v]`` so the TP loader slices it by head);
with ``qk_layernorm`` a LayerNorm over each q and k head (one weight shared by the heads, so it is
replicated on every rank); rotary embedding over the first ``partial_rotary_factor`` of each head;
a ``relu2`` MLP (``dense_h_to_4h``, ``dense_4h_to_h``) and a ``final_layernorm``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.layer import Attention
from ferrollm.distributed import get_tensor_model_parallel_world_size
from ferrollm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear, divide
from ferrollm.model_executor.layers.norm import LayerNorm
from ferrollm.model_executor.layers.rotary import get_rope, rope_max_position, rope_parameters
from ferrollm.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from ferrollm.model_executor.models.gpt_neox import GPTNeoXMLP, stack_per_head_qkv
from ferrollm.model_executor.models.utils import CausalLMInterface, load_weights_into

__all__ = ["PersimmonForCausalLM", "PersimmonModel"]

# Buffers older checkpoints saved; derived from the config.
_BUFFERS = (".rotary_emb.inv_freq",)


class PersimmonAttention(nn.Module):
    """Multi-head attention: fused qkv, optional per-head q/k LayerNorm, partial rotary."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        self.head_dim = hidden // num_heads
        self.query_key_value = QKVParallelLinear(hidden, self.head_dim, num_heads, num_heads, True, dtype)
        self.dense = RowParallelLinear(hidden, hidden, True, params_dtype=dtype)
        self.qk_layernorm = bool(getattr(config, "qk_layernorm", True))
        if self.qk_layernorm:
            self.q_layernorm = LayerNorm(self.head_dim, config.layer_norm_eps, dtype)
            self.k_layernorm = LayerNorm(self.head_dim, config.layer_norm_eps, dtype)
        self.rotary_emb = get_rope(self.head_dim, rope_max_position(config), rope_parameters(config),
                                   dtype=dtype)
        self.q_size, self.kv_size = self.query_key_value.q_size, self.query_key_value.kv_size
        self.attn = Attention(self.query_key_value.num_heads, self.head_dim, self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.query_key_value(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.qk_layernorm:
            # Normalised before the rotary embedding, as transformers does.
            q = self.q_layernorm(q.unflatten(-1, (-1, self.head_dim))).flatten(-2)
            k = self.k_layernorm(k.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v, kv_cache, attn_metadata))


class PersimmonDecoderLayer(nn.Module):
    """``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.self_attn = PersimmonAttention(config, dtype)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.mlp = GPTNeoXMLP(config, dtype)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        hidden_states = hidden_states + self.self_attn(positions, self.input_layernorm(hidden_states), kv_cache,
                                                       attn_metadata)
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class PersimmonModel(nn.Module):
    """Embedding, layers and the final LayerNorm."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(PersimmonDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.final_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, input_ids, positions, kv_caches, attn_metadata, inputs_embeds=None):
        # Fuyu passes the embeddings with its image patches' rows already merged in.
        hidden_states = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states = layer(positions, hidden_states, kv_cache, attn_metadata)
        return self.final_layernorm(hidden_states)


class PersimmonForCausalLM(CausalLMInterface, nn.Module):
    """Persimmon decoder with an LM head.

    Args:
        config: the HF ``PersimmonConfig``.
        dtype: parameter and activation dtype.
    """

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.model = PersimmonModel(config, dtype)
        # Multi-head attention: each rank caches keys and values of the heads it holds.
        self.num_kv_heads = divide(self.num_heads, get_tensor_model_parallel_world_size(), "num_attention_heads")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Runs one step; same contract as :meth:`LlamaForCausalLM.forward`."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads an HF Persimmon checkpoint's tensors by name.

        Returns:
            The parameter names loaded.

        Raises:
            CheckpointError: for unknown, missing or mis-shaped tensors.
        """
        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        return load_weights_into(self, self._to_model_layout(weights), [], skip)

    def _to_model_layout(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Drops buffers and regroups ``query_key_value`` for the fused loader."""
        for name, tensor in weights:
            if name.endswith(_BUFFERS):
                continue
            if ".query_key_value." in name:
                tensor = stack_per_head_qkv(tensor, self.num_heads, self.head_dim)
            yield name, tensor
