"""The attention layer models call: writes this step's keys and values into the paged cache, then
attends over each request's whole context."""

from __future__ import annotations

import torch
from torch import nn

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.selector import get_attn_backend
from ferrollm.exceptions import EngineError

__all__ = ["Attention"]


class Attention(nn.Module):
    """Paged, causal, grouped-query attention over the step's requests.

    The backend follows the KV cache's device (:func:`~ferrollm.attention.selector.get_attn_backend`):
    Triton kernels for CUDA tensors, torch for CPU tensors, with no change to model code.

    Args:
        num_heads: query heads on this rank.
        head_size: size of one head.
        scale: score multiplier, usually ``head_size ** -0.5``.
        num_kv_heads: KV heads on this rank (default ``num_heads``).
        sliding_window: attend to the last ``sliding_window`` positions only.
        logits_soft_cap: cap scores with ``cap * tanh(score / cap)``.
    """

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        # vLLM's per-tensor scales of an fp8 KV cache (stored = x / scale); 1.0 unless set.
        self.k_scale = 1.0
        self.v_scale = 1.0
        # This layer's position in the model's KV caches, set by `bind_kv_cache_indices` before
        # the model is compiled: a compiled forward reaches its cache through the forward context.
        self.kv_cache_index: int | None = None

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, attn_metadata: AttentionMetadata) -> torch.Tensor:
        """Attention for one layer.

        Args:
            query: ``[num_tokens, num_heads * head_size]``.
            key: ``[num_tokens, num_kv_heads * head_size]``.
            value: same shape as ``key``.
            kv_cache: this layer's ``[2, num_blocks, block_size, num_kv_heads, head_size]``.
            attn_metadata: the step's metadata.

        Returns:
            ``[num_tokens, num_heads * head_size]``.
        """
        if torch.compiler.is_compiling():
            return self._compiled_forward(query, key, value)
        num_tokens = query.shape[0]
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        backend = get_attn_backend(kv_cache.device)
        # Only an fp8 cache (one byte per element) takes scales; only the CPU backend has one.
        scales = (self.k_scale, self.v_scale) if kv_cache.element_size() == 1 else ()
        backend.write_kv(key, value, kv_cache, attn_metadata.slot_mapping, *scales)
        out = backend.paged_attention(
            query.view(num_tokens, self.num_heads, self.head_size), kv_cache, attn_metadata,
            self.scale, self.sliding_window, self.logits_soft_cap, *scales,
        )
        if attn_metadata.image_spans:
            from ferrollm.attention.image_spans import attend_image_spans

            attend_image_spans(out, query.view(num_tokens, self.num_heads, self.head_size), kv_cache, attn_metadata,
                               self.scale, self.sliding_window, self.logits_soft_cap, *scales)
        return out.view(num_tokens, self.num_heads * self.head_size)

    def _compiled_forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # One opaque op per layer (see forward_context): the step's metadata stays out of the trace.
        from ferrollm.attention.forward_context import unified_attention

        if self.kv_cache_index is None:
            raise EngineError("an attention layer was compiled before bind_kv_cache_indices numbered it")
        return unified_attention(query, key, value, self.kv_cache_index, self.num_heads, self.num_kv_heads,
                                 self.head_size, self.scale, self.sliding_window, self.logits_soft_cap)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_size={self.head_size}, "
                f"sliding_window={self.sliding_window}")
