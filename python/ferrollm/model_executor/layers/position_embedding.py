"""Learned absolute position embeddings (GPT-2's ``wpe``, OPT's ``embed_positions``).

The table is small (positions x hidden), so every rank holds it whole and no communication is
needed. The engine's positions start at 0 for a request's first token; ``offset`` shifts them for
checkpoints whose table reserves leading rows (OPT keeps two).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrollm.model_executor.weight_utils import share_or_copy

__all__ = ["LearnedPositionEmbedding"]


class LearnedPositionEmbedding(nn.Module):
    """Looks up ``weight[positions + offset]``.

    Args:
        num_positions: positions the model supports (``max_position_embeddings``).
        embedding_dim: hidden size.
        offset: rows of the checkpoint's table before position 0; the table has
            ``num_positions + offset`` rows.
        params_dtype: parameter dtype.
    """

    def __init__(self, num_positions: int, embedding_dim: int, offset: int = 0,
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_positions = num_positions
        self.offset = offset
        weight = torch.empty(num_positions + offset, embedding_dim, dtype=params_dtype)
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        share_or_copy(param, loaded_weight, "position embedding table")

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` int64 positions -> ``[num_tokens, embedding_dim]``."""
        return F.embedding(positions + self.offset, self.weight)

    def extra_repr(self) -> str:
        return f"positions={self.num_positions}, offset={self.offset}, dim={self.weight.shape[1]}"
