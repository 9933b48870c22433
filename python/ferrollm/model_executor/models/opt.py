"""OPT (facebook/opt-*) on the paged-attention interface.

Learned absolute positions whose table starts two rows before position 0, LayerNorm blocks that
normalise before (``do_layer_norm_before``, most sizes) or after (opt-350m) each sub-layer, a
plain MLP (``fc1``/``fc2``, ReLU), and the LM head tied to the token embedding. When
``word_embed_proj_dim`` differs from ``hidden_size`` (opt-350m), the embeddings live in the smaller
space and ``project_in``/``project_out`` map to and from the hidden size.
"""

from __future__ import annotations

from collections.abc import Iterable

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
    ReplicatedLinear,
    RowParallelLinear,
    divide,
)
from ferrollm.model_executor.layers.norm import LayerNorm
from ferrollm.model_executor.layers.position_embedding import LearnedPositionEmbedding
from ferrollm.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from ferrollm.model_executor.models.utils import CausalLMInterface, load_weights_into

__all__ = ["OPTForCausalLM"]

# OPT's position table keeps two rows before position 0 (a fairseq padding convention).
POSITION_OFFSET = 2


def _layer_norm(config: PretrainedConfig, dtype: torch.dtype) -> LayerNorm:
    return LayerNorm(config.hidden_size, 1e-5, dtype,
                     elementwise_affine=getattr(config, "layer_norm_elementwise_affine", True))


class OPTAttention(nn.Module):
    """Multi-head attention; q/k/v fused into ``qkv_proj``, output ``out_proj``."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // num_heads
        bias = getattr(config, "enable_bias", True)
        self.qkv_proj = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, bias, dtype)
        self.out_proj = RowParallelLinear(hidden, hidden, bias, params_dtype=dtype)
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.attn = Attention(self.qkv_proj.num_heads, head_dim, head_dim**-0.5)

    def forward(self, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.out_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class OPTDecoderLayer(nn.Module):
    """Attention then MLP, each with a residual; LayerNorm before or after each."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        bias = getattr(config, "enable_bias", True)
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, dtype)
        self.self_attn_layer_norm = _layer_norm(config, dtype)
        self.fc1 = ColumnParallelLinear(config.hidden_size, config.ffn_dim, bias, params_dtype=dtype)
        self.activation_fn = get_act_fn(config.activation_function)
        self.fc2 = RowParallelLinear(config.ffn_dim, config.hidden_size, bias, params_dtype=dtype)
        self.final_layer_norm = _layer_norm(config, dtype)

    def forward(self, hidden_states, kv_cache, attn_metadata):
        pre = self.do_layer_norm_before
        residual = hidden_states
        if pre:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, kv_cache, attn_metadata)
        if not pre:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if pre:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + self.fc2(self.activation_fn(self.fc1(hidden_states)))
        if not pre:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(nn.Module):
    """Embeddings (with the optional projections), the layers and the optional final norm."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        embed_dim = config.word_embed_proj_dim
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, embed_dim, dtype)
        self.embed_positions = LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size,
                                                        POSITION_OFFSET, dtype)
        self.project_in = self.project_out = None
        if embed_dim != config.hidden_size:
            self.project_in = ReplicatedLinear(embed_dim, config.hidden_size, False, dtype)
            self.project_out = ReplicatedLinear(config.hidden_size, embed_dim, False, dtype)
        self.final_layer_norm = None
        if config.do_layer_norm_before and not getattr(config, "_remove_final_layer_norm", False):
            self.final_layer_norm = _layer_norm(config, dtype)
        self.layers = nn.ModuleList(OPTDecoderLayer(config, dtype) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden_states = self.embed_tokens(input_ids)
        if self.project_in is not None:
            hidden_states = self.project_in(hidden_states)
        hidden_states = hidden_states + self.embed_positions(positions)
        for layer, kv_cache in zip(self.layers, kv_caches):
            hidden_states = layer(hidden_states, kv_cache, attn_metadata)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states


class OPTModel(nn.Module):
    """Holds the decoder, so parameter names match HF's ``model.decoder.*``."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        self.decoder = OPTDecoder(config, dtype)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        return self.decoder(input_ids, positions, kv_caches, attn_metadata)


class OPTForCausalLM(CausalLMInterface, nn.Module):
    """OPT decoder with an LM head over ``word_embed_proj_dim`` features.

    Args:
        config: the HF ``OPTConfig``.
        dtype: parameter and activation dtype.
    """

    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
    ]

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.model = OPTModel(config, dtype)
        # Multi-head attention: each rank caches keys and values of the heads it holds.
        self.num_kv_heads = divide(config.num_attention_heads, get_tensor_model_parallel_world_size(),
                                   "num_attention_heads")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.word_embed_proj_dim, params_dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.model.decoder.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Runs one step; same contract as :meth:`LlamaForCausalLM.forward`."""
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads an HF OPT checkpoint's tensors by name (``model.decoder.*`` or ``decoder.*``).

        Returns:
            The parameter names loaded.

        Raises:
            CheckpointError: for unknown, missing or mis-shaped tensors.
        """
        # The original release's files name the decoder without the `model.` prefix.
        prefixed = ((f"model.{name}" if name.startswith("decoder.") else name, tensor)
                    for name, tensor in weights)
        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        return load_weights_into(self, prefixed, self.stacked_params_mapping, skip)
