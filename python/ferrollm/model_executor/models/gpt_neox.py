"""GPT-NeoX (Pythia, GPT-NeoX-20B) on the paged-attention interface.

Rotary embedding over the first ``partial_rotary_factor`` (older configs: ``rotary_pct``) of each
head, LayerNorm blocks, and by default the parallel residual ``x + attn(ln1(x)) + mlp(ln2(x))``.
The checkpoint's ``query_key_value`` interleaves the projections per head (``[q_h, k_h, v_h]`` for
each head ``h``); ``load_weights`` regroups it into ``[q; k; v]`` so the TP loader can slice it by
head. The LM head is stored as ``embed_out``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.layer import Attention
from ferrollm.distributed import get_tensor_model_parallel_world_size
from ferrollm.model_executor.layers.activation import get_act_fn
from ferrollm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
)
from ferrollm.model_executor.layers.norm import LayerNorm
from ferrollm.model_executor.layers.rotary import get_rope, rope_max_position, rope_parameters
from ferrollm.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from ferrollm.model_executor.models.utils import CausalLMInterface, load_weights_into

__all__ = ["GPTNeoXForCausalLM", "GPTNeoXMLP", "stack_per_head_qkv"]

# Buffers older checkpoints saved (causal mask, rotary frequencies); all derived from the config.
_BUFFERS = (".attention.bias", ".attention.masked_bias", ".rotary_emb.inv_freq")


class GPTNeoXAttention(nn.Module):
    """Multi-head attention with partial rotary embedding."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // num_heads
        bias = getattr(config, "attention_bias", True)
        self.query_key_value = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, bias, dtype)
        self.dense = RowParallelLinear(hidden, hidden, bias, params_dtype=dtype)
        self.rotary_emb = get_rope(head_dim, rope_max_position(config), rope_parameters(config),
                                   dtype=dtype)
        self.q_size, self.kv_size = self.query_key_value.q_size, self.query_key_value.kv_size
        self.attn = Attention(self.query_key_value.num_heads, head_dim, head_dim**-0.5)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.query_key_value(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.dense(self.attn(q, k, v, kv_cache, attn_metadata))


class GPTNeoXMLP(nn.Module):
    """``dense_4h_to_h(act(dense_h_to_4h(x)))``."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        self.dense_h_to_4h = ColumnParallelLinear(config.hidden_size, config.intermediate_size, True,
                                                  params_dtype=dtype)
        self.act = get_act_fn(config.hidden_act)
        self.dense_4h_to_h = RowParallelLinear(config.intermediate_size, config.hidden_size, True,
                                               params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense_4h_to_h(self.act(self.dense_h_to_4h(x)))


class GPTNeoXLayer(nn.Module):
    """Attention and MLP side by side (``use_parallel_residual``) or one after the other."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        self.use_parallel_residual = getattr(config, "use_parallel_residual", True)
        self.input_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)
        self.attention = GPTNeoXAttention(config, dtype)
        self.mlp = GPTNeoXMLP(config, dtype)

    def forward(self, positions, hidden_states, kv_cache, attn_metadata):
        attn_out = self.attention(positions, self.input_layernorm(hidden_states), kv_cache, attn_metadata)
        if self.use_parallel_residual:
            return hidden_states + attn_out + self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = hidden_states + attn_out
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class GPTNeoXModel(nn.Module):
    """Embedding, layers and the final LayerNorm."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        self.embed_in = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(GPTNeoXLayer(config, dtype) for _ in range(config.num_hidden_layers))
        self.final_layer_norm = LayerNorm(config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden_states = self.embed_in(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states = layer(positions, hidden_states, kv_cache, attn_metadata)
        return self.final_layer_norm(hidden_states)


class GPTNeoXForCausalLM(CausalLMInterface, nn.Module):
    """GPT-NeoX decoder with an LM head (``embed_out`` in checkpoints).

    Args:
        config: the HF ``GPTNeoXConfig``.
        dtype: parameter and activation dtype.
    """

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.gpt_neox = GPTNeoXModel(config, dtype)
        # Multi-head attention: each rank caches keys and values of the heads it holds.
        self.num_kv_heads = divide(config.num_attention_heads, get_tensor_model_parallel_world_size(),
                                   "num_attention_heads")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.gpt_neox.embed_in)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Runs one step; same contract as :meth:`LlamaForCausalLM.forward`."""
        return self.gpt_neox(input_ids, positions, kv_caches, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads an HF GPT-NeoX checkpoint's tensors by name.

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
        """Renames ``embed_out`` to ``lm_head``, drops buffers, regroups ``query_key_value``."""
        for name, tensor in weights:
            if name.endswith(_BUFFERS):
                continue
            if name.startswith("embed_out."):
                name = "lm_head." + name[len("embed_out."):]
            if ".query_key_value." in name:
                tensor = stack_per_head_qkv(tensor, self.num_heads, self.head_dim)
            yield name, tensor


def stack_per_head_qkv(tensor: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """A fused qkv weight or bias stored per head (rows ``[head, (q|k|v), head_dim]``, as GPT-NeoX
    and Persimmon store it) in the ``[(q|k|v), head, head_dim]`` rows the fused loader slices by
    head for each tensor-parallel rank."""
    per_head = tensor.unflatten(0, (num_heads, 3, head_dim))
    return per_head.transpose(0, 1).reshape(tensor.shape)
