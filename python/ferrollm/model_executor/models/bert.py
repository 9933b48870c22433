"""BERT as an encoder-only pooling model (sentence-transformers' MiniLM, BGE, E5 and the like).

Post-norm blocks over bidirectional attention: absolute position and token-type embeddings,
LayerNorm, GELU. Every prompt is attended whole in the step that schedules it (no KV cache, no
chunking), so the model ignores ``kv_caches`` and reads each prompt's extent from the step's
``query_start_loc``. Single-sentence embeddings use token type 0 throughout, as
sentence-transformers does.

Parameter names follow HF's (``embeddings.*``, ``encoder.layer.N.*``) except that
``attention.self.{query,key,value}`` are fused into ``attention.qkv_proj``. Checkpoints saved
from ``BertForMaskedLM`` (``bert.`` prefix, ``cls.*`` head) load too; the heads and BERT's own
``pooler`` are skipped, as vLLM's embedding model skips them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.encoder import EncoderAttention, EncoderBatch
from ferrollm.exceptions import UnsupportedModelError
from ferrollm.model_executor.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from ferrollm.model_executor.layers.vocab import VocabParallelEmbedding
from ferrollm.model_executor.models.utils import load_weights_into

__all__ = ["BertModel"]

_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _layer_norm(size: int, eps: float, dtype: torch.dtype) -> nn.LayerNorm:
    norm = nn.LayerNorm(size, eps=eps, dtype=dtype)
    norm.requires_grad_(False)
    return norm


class BertEmbeddings(nn.Module):
    """Word + absolute position + token type embeddings, then LayerNorm."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size, dtype=dtype)
        self.LayerNorm = _layer_norm(config.hidden_size, config.layer_norm_eps, dtype)
        self.requires_grad_(False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        return self.LayerNorm(x + self.token_type_embeddings.weight[0])


class BertSelfOutput(nn.Module):
    """Projection, residual add, LayerNorm (HF's ``BertSelfOutput`` and ``BertOutput``)."""

    def __init__(self, input_size: int, hidden_size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.dense = RowParallelLinear(input_size, hidden_size, bias=True, params_dtype=dtype)
        self.LayerNorm = _layer_norm(hidden_size, eps, dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class BertAttention(nn.Module):
    """Fused qkv projection, bidirectional attention, output block."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        num_heads = config.num_attention_heads
        head_size = config.hidden_size // num_heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, head_size, num_heads, num_heads,
                                          bias=True, params_dtype=dtype)
        self.attn = EncoderAttention(self.qkv_proj.num_heads, head_size, head_size**-0.5)
        self.q_size = self.qkv_proj.q_size
        self.output = BertSelfOutput(config.hidden_size, config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, hidden_states: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states).split([self.q_size] * 3, dim=-1)
        return self.output(self.attn(q, k, v, batch), hidden_states)


class BertIntermediate(nn.Module):
    """The feed-forward expansion and its activation."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        act = config.hidden_act
        if act not in _ACTIVATIONS:
            raise UnsupportedModelError(f"BERT hidden_act {act!r} is not supported; supported: {sorted(_ACTIVATIONS)}")
        self.act_fn = _ACTIVATIONS[act]
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, bias=True, params_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act_fn(self.dense(x))


class BertLayer(nn.Module):
    """One post-norm encoder block."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        self.attention = BertAttention(config, dtype)
        self.intermediate = BertIntermediate(config, dtype)
        self.output = BertSelfOutput(config.intermediate_size, config.hidden_size, config.layer_norm_eps, dtype)

    def forward(self, hidden_states: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        attended = self.attention(hidden_states, batch)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, dtype) for _ in range(config.num_hidden_layers))

    def forward(self, hidden_states: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        for layer in self.layer:
            hidden_states = layer(hidden_states, batch)
        return hidden_states


class BertModel(nn.Module):
    """BERT encoder returning the last hidden state of every token.

    Args:
        config: the HF ``BertConfig``.
        dtype: parameter and activation dtype.
    """

    # An encoder: it runs only as a pooling model, CLS-pooled unless the checkpoint says otherwise.
    is_pooling_model = True
    default_pooling_type = "CLS"

    stacked_params_mapping: list[tuple[str, str, str | int]] = [
        (".attention.qkv_proj", ".attention.self.query", "q"),
        (".attention.qkv_proj", ".attention.self.key", "k"),
        (".attention.qkv_proj", ".attention.self.value", "v"),
    ]
    # Tensors of the pretraining/classification heads and buffers the model does not use.
    _skipped = ("pooler.", "cls.", "classifier.", "position_ids")

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        position_type = getattr(config, "position_embedding_type", None) or "absolute"
        if position_type != "absolute":
            raise UnsupportedModelError(f"BERT position_embedding_type {position_type!r} is not supported; only 'absolute'")
        self.config = config
        self.dtype = dtype
        self.embeddings = BertEmbeddings(config, dtype)
        self.encoder = BertEncoder(config, dtype)

    def kv_cache_spec(self) -> None:
        """An encoder keeps no KV cache."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Encodes the step's prompts.

        Args:
            input_ids: int64 ``[num_tokens]``, the prompts one after another.
            positions: int64 ``[num_tokens]``, each token's position in its prompt.
            kv_caches: ignored (encoders keep no cache).
            attn_metadata: the step's metadata; ``query_start_loc`` delimits the prompts.

        Returns:
            Final hidden states ``[num_tokens, hidden_size]``.
        """
        batch = EncoderBatch.from_metadata(attn_metadata)
        return self.encoder(self.embeddings(input_ids, positions), batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads a ``BertModel`` (or ``BertForMaskedLM``) checkpoint by HF name.

        Raises:
            CheckpointError: for unknown, missing or mis-shaped tensors.
        """
        return load_weights_into(self, _encoder_tensors(weights), self.stacked_params_mapping, self._skipped)


def _encoder_tensors(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Drops the ``bert.`` prefix task-head checkpoints put before the encoder's names."""
    for name, tensor in weights:
        yield name.removeprefix("bert."), tensor
