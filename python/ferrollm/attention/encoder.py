"""Bidirectional (encoder-only) attention over whole prompts, without a KV cache.

Encoder models see every token of their prompt at once, so a step's requests are laid out as a
padded ``[num_reqs, max_len]`` batch and attended with one ``scaled_dot_product_attention`` call
that masks each row's padding keys. The layout (:class:`EncoderBatch`) is computed once per step
and shared by every layer. Padding query rows compute harmless values that are never read back.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ferrollm.attention.backend import AttentionMetadata

__all__ = ["EncoderAttention", "EncoderBatch"]


@dataclass
class EncoderBatch:
    """Where each token of a flat step goes in the padded batch.

    Attributes:
        num_reqs: requests in the step.
        max_len: the longest prompt.
        padded_index: int64 ``[num_tokens]``, the token's row in the flattened
            ``[num_reqs * max_len]`` batch.
        key_mask: bool ``[num_reqs, 1, 1, max_len]``, True for real (non-padding) keys; None
            when every prompt has the same length.
    """

    num_reqs: int
    max_len: int
    padded_index: torch.Tensor
    key_mask: torch.Tensor | None

    @classmethod
    def from_metadata(cls, meta: AttentionMetadata) -> EncoderBatch:
        """Builds the layout from a step whose requests all start at position 0.

        Args:
            meta: the step's metadata (``query_start_loc`` gives each prompt's tokens).
        """
        loc = meta.query_start_loc.long()
        lengths = loc[1:] - loc[:-1]
        device = loc.device
        owner = torch.repeat_interleave(torch.arange(meta.num_reqs, device=device), lengths)
        offset = torch.arange(meta.num_tokens, device=device) - loc[:-1][owner]
        max_len = meta.max_query_len
        mask = None
        if meta.num_reqs > 1 and int(lengths.min()) != max_len:
            mask = (torch.arange(max_len, device=device)[None, :] < lengths[:, None])[:, None, None, :]
        return cls(meta.num_reqs, max_len, owner * max_len + offset, mask)


class EncoderAttention(nn.Module):
    """Multi-head attention of every prompt token over every token of the same prompt.

    Args:
        num_heads: heads on this rank.
        head_size: size of one head.
        scale: score multiplier, usually ``head_size ** -0.5``.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                batch: EncoderBatch) -> torch.Tensor:
        """Attention for one layer.

        Args:
            query, key, value: ``[num_tokens, num_heads * head_size]``.
            batch: the step's layout.

        Returns:
            ``[num_tokens, num_heads * head_size]``.
        """
        num_tokens = query.shape[0]
        q, k, v = (self._pad(x, batch) for x in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.key_mask, scale=self.scale)
        # [reqs, heads, len, dim] -> [reqs * len, heads * dim], then back to the flat order.
        out = out.transpose(1, 2).reshape(batch.num_reqs * batch.max_len, -1)
        return out[batch.padded_index].view(num_tokens, -1)

    def _pad(self, x: torch.Tensor, batch: EncoderBatch) -> torch.Tensor:
        """``[num_tokens, heads * dim]`` -> ``[reqs, heads, max_len, dim]`` (padding zeroed)."""
        width = self.num_heads * self.head_size
        padded = x.new_zeros(batch.num_reqs * batch.max_len, width).index_copy_(0, batch.padded_index, x)
        return padded.view(batch.num_reqs, batch.max_len, self.num_heads, self.head_size).transpose(1, 2)

    def extra_repr(self) -> str:
        return f"heads={self.num_heads}, head_size={self.head_size}, bidirectional"
