"""Llama (and the checkpoints that share its layout) on the paged-attention interface.

Parameter names follow HF's after fusing q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj``,
so ``load_weights`` takes HF checkpoint names. Subclasses (Qwen2) change biases and sliding windows
through the ``_qkv_bias``/``_sliding_window`` hooks.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.layer import Attention
from ferrollm.exceptions import UnsupportedModelError
from ferrollm.model_executor.layers.activation import SiluAndMul
from ferrollm.model_executor.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from ferrollm.model_executor.layers.norm import RMSNorm
from ferrollm.model_executor.layers.rotary import get_rope, rope_parameters
from ferrollm.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from ferrollm.model_executor.models.utils import load_weights_into

__all__ = ["LlamaForCausalLM"]


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool,
                 dtype: torch.dtype):
        super().__init__()
        if hidden_act != "silu":
            raise UnsupportedModelError(f"hidden_act {hidden_act!r} is not supported; only 'silu'")
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias, dtype)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, params_dtype=dtype)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, rotary embedding, paged attention, output projection."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, qkv_bias: bool, o_bias: bool,
                 sliding_window: int | None):
        super().__init__()
        head_dim = _head_dim(config)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, qkv_bias, dtype)
        self.o_proj = RowParallelLinear(config.num_attention_heads * head_dim, config.hidden_size,
                                        o_bias, params_dtype=dtype)
        self.rotary_emb = get_rope(head_dim, config.max_position_embeddings,
                                   rope_parameters(config), dtype=dtype)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5,
                              self.qkv_proj.num_kv_heads, sliding_window)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; the residual stream is passed along separately so the norms fuse the add."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, qkv_bias: bool,
                 sliding_window: int | None):
        super().__init__()
        o_bias = getattr(config, "attention_bias", False)
        self.self_attn = LlamaAttention(config, dtype, qkv_bias, o_bias, sliding_window)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            getattr(config, "mlp_bias", False), dtype)
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


class LlamaModel(nn.Module):
    """Embedding, decoder layers and the final norm."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, layers: Iterable[nn.Module]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden_states, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """Llama decoder with an LM head.

    Args:
        config: the HF config (``LlamaConfig`` or compatible).
        dtype: parameter and activation dtype.
    """

    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.head_dim = _head_dim(config)
        layers = [LlamaDecoderLayer(config, dtype, self._qkv_bias(config), self._sliding_window(config, i))
                  for i in range(self.num_layers)]
        self.model = LlamaModel(config, dtype, layers)
        # Per rank: the KV cache is allocated for the heads this rank holds.
        self.num_kv_heads = layers[0].self_attn.qkv_proj.num_kv_heads if layers else 0
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.embed_tokens)

    @staticmethod
    def _qkv_bias(config: PretrainedConfig) -> bool:
        return bool(getattr(config, "attention_bias", False))

    @staticmethod
    def _sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
        return None

    def kv_cache_spec(self) -> tuple[int, int, int]:
        """``(num_layers, num_kv_heads on this rank, head_dim)`` for sizing the KV cache."""
        return self.num_layers, self.num_kv_heads, self.head_dim

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Runs one step.

        Args:
            input_ids: int64 ``[num_tokens]``.
            positions: int64 ``[num_tokens]``.
            kv_caches: one tensor per layer, from ``allocate_kv_cache``.
            attn_metadata: the step's metadata.

        Returns:
            Final hidden states ``[num_tokens, hidden_size]``.
        """
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """float32 ``[num_rows, vocab_size]`` logits of the given hidden-state rows."""
        return self.lm_head.compute_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads an HF checkpoint's tensors by name.

        Args:
            weights: ``(hf_name, tensor)`` pairs, e.g. from ``iterate_safetensors``.

        Returns:
            The parameter names loaded.

        Raises:
            CheckpointError: for unknown, missing or mis-shaped tensors.
        """
        skip = ("rotary_emb.inv_freq",)
        if self.tie_word_embeddings:
            # Some tied checkpoints still store a copy of the embedding as lm_head.
            skip += ("lm_head.",)
        return load_weights_into(self, weights, self.stacked_params_mapping, skip)
