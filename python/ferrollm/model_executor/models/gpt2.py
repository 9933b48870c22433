"""GPT-2 on the paged-attention interface.

Learned absolute positions (``wpe``) instead of rotary, pre-norm LayerNorm blocks, a fused
``c_attn`` projection and the LM head tied to ``wte``. GPT-2's ``Conv1D`` stores weights as
``[in, out]``, the transpose of ``nn.Linear``'s, so ``load_weights`` transposes them before the
TP-aware loaders slice them. Checkpoints from the original release lack the ``transformer.``
prefix and carry the causal-mask buffers ``attn.bias``/``attn.masked_bias``; both are handled.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.layer import Attention
from ferrollm.distributed import get_tensor_model_parallel_world_size
from ferrollm.exceptions import UnsupportedModelError
from ferrollm.model_executor.layers.activation import get_act_fn
from ferrollm.model_executor.layers.linear import (
    ColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    divide,
)
from ferrollm.model_executor.layers.norm import LayerNorm
from ferrollm.model_executor.layers.position_embedding import LearnedPositionEmbedding
from ferrollm.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding
from ferrollm.model_executor.models.utils import CausalLMInterface, load_weights_into

__all__ = ["GPT2LMHeadModel"]

# Checkpoint tensors stored as Conv1D [in, out].
_CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Causal-mask buffers some checkpoints saved; the paged attention builds its own mask.
_MASK_BUFFERS = (".attn.bias", ".attn.masked_bias")


class GPT2Attention(nn.Module):
    """Multi-head attention with the fused ``c_attn`` (q, k, v) and ``c_proj`` projections."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, layer_idx: int):
        super().__init__()
        hidden, num_heads = config.hidden_size, config.num_attention_heads
        head_dim = hidden // num_heads
        self.c_attn = QKVParallelLinear(hidden, head_dim, num_heads, num_heads, True, dtype)
        self.c_proj = RowParallelLinear(hidden, hidden, True, params_dtype=dtype)
        scale = head_dim**-0.5 if getattr(config, "scale_attn_weights", True) else 1.0
        if getattr(config, "scale_attn_by_inverse_layer_idx", False):
            scale /= layer_idx + 1
        self.q_size, self.kv_size = self.c_attn.q_size, self.c_attn.kv_size
        self.attn = Attention(self.c_attn.num_heads, head_dim, scale)

    def forward(self, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.c_attn(hidden_states).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self.c_proj(self.attn(q, k, v, kv_cache, attn_metadata))


class GPT2MLP(nn.Module):
    """``c_proj(act(c_fc(x)))``."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        inner = config.n_inner or 4 * config.hidden_size
        self.c_fc = ColumnParallelLinear(config.hidden_size, inner, True, params_dtype=dtype)
        self.act = get_act_fn(config.activation_function)
        self.c_proj = RowParallelLinear(inner, config.hidden_size, True, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.act(self.c_fc(x)))


class GPT2Block(nn.Module):
    """``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype, layer_idx: int):
        super().__init__()
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps, dtype)
        self.attn = GPT2Attention(config, dtype, layer_idx)
        self.ln_2 = LayerNorm(config.hidden_size, eps, dtype)
        self.mlp = GPT2MLP(config, dtype)

    def forward(self, hidden_states, kv_cache, attn_metadata):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), kv_cache, attn_metadata)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    """Token and position embeddings, the blocks and the final LayerNorm."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        self.wte = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.wpe = LearnedPositionEmbedding(config.max_position_embeddings, config.hidden_size,
                                            params_dtype=dtype)
        self.h = nn.ModuleList(GPT2Block(config, dtype, i) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.layer_norm_epsilon, dtype)

    def forward(self, input_ids, positions, kv_caches, attn_metadata):
        hidden_states = self.wte(input_ids) + self.wpe(positions)
        for block, kv_cache in zip(self.h, kv_caches):
            hidden_states = block(hidden_states, kv_cache, attn_metadata)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(CausalLMInterface, nn.Module):
    """GPT-2 decoder with an LM head (tied to ``wte`` unless the config says otherwise).

    Args:
        config: the HF ``GPT2Config``.
        dtype: parameter and activation dtype.

    Raises:
        UnsupportedModelError: for configs with cross-attention (encoder-decoder use).
    """

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        if getattr(config, "add_cross_attention", False):
            raise UnsupportedModelError("GPT-2 with add_cross_attention=True is not supported")
        self.config = config
        self.dtype = dtype
        self.num_layers = config.num_hidden_layers
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.transformer = GPT2Model(config, dtype)
        # Multi-head attention: each rank caches keys and values of the heads it holds.
        self.num_kv_heads = divide(config.num_attention_heads, get_tensor_model_parallel_world_size(),
                                   "num_attention_heads")
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, params_dtype=dtype)
        if self.tie_word_embeddings:
            self.lm_head.tie_weights(self.transformer.wte)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Runs one step; same contract as :meth:`LlamaForCausalLM.forward`."""
        return self.transformer(input_ids, positions, kv_caches, attn_metadata)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads an HF GPT-2 checkpoint's tensors by name (with or without ``transformer.``).

        Returns:
            The parameter names loaded.

        Raises:
            CheckpointError: for unknown, missing or mis-shaped tensors.
        """
        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        return load_weights_into(self, _to_linear_layout(weights), [], skip)


def _to_linear_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Adds the ``transformer.`` prefix where missing, drops mask buffers, transposes Conv1D."""
    for name, tensor in weights:
        if name.endswith(_MASK_BUFFERS):
            continue
        if not name.startswith(("transformer.", "lm_head.")):
            name = f"transformer.{name}"
        if name.endswith(_CONV1D_WEIGHTS):
            tensor = tensor.t()
        yield name, tensor
