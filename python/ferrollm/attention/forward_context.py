"""Where a compiled model's attention finds the step: the forward context and one custom op.

``torch.compile`` traces the model once and reuses the trace for every step, so nothing that
changes per step may be baked into it as a constant. The step's `AttentionMetadata` is mostly
Python ints (token counts, the longest sequence), and the KV cache is written in place, which a
compiler would otherwise have to functionalize (a copy of the cache per layer). So, as vLLM does,
the attention layers of a compiled model call :func:`unified_attention`, a custom op that the
compiler sees as opaque (``q, k, v -> out``); the op reads the metadata and its layer's cache
from the forward context that the runner sets around each forward. The op is also where
CompilationLevel.PIECEWISE cuts the graph (worker/compiler.py).

A layer finds its cache by index (``Attention.kv_cache_index``), recorded once by
:func:`bind_kv_cache_indices` from an eager forward, so models need not number their layers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.selector import get_attn_backend
from ferrollm.exceptions import EngineError

__all__ = ["ForwardContext", "bind_kv_cache_indices", "get_forward_context", "set_forward_context",
           "unified_attention"]


@dataclass
class ForwardContext:
    """One forward's attention inputs: the step's metadata and every layer's KV cache."""

    attn_metadata: AttentionMetadata
    kv_caches: list[torch.Tensor]


_context: ForwardContext | None = None


@contextmanager
def set_forward_context(attn_metadata: AttentionMetadata, kv_caches: list[torch.Tensor]) -> Iterator[None]:
    """Makes ``attn_metadata`` and ``kv_caches`` the ones :func:`unified_attention` reads."""
    global _context
    saved, _context = _context, ForwardContext(attn_metadata, kv_caches)
    try:
        yield
    finally:
        _context = saved


def get_forward_context() -> ForwardContext:
    """The context of the forward running now.

    Raises:
        EngineError: outside :func:`set_forward_context`.
    """
    if _context is None:
        raise EngineError("a compiled model's attention ran outside set_forward_context")
    return _context


@torch.library.custom_op("ferrollm::unified_attention", mutates_args=())
def unified_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache_index: int,
                      num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                      sliding_window: int | None, logits_soft_cap: float | None) -> torch.Tensor:
    """Writes this step's keys and values into layer ``kv_cache_index``'s cache and attends.

    The cache write is invisible to the compiler on purpose (the cache is not an argument), as in
    vLLM's ``unified_attention``: nothing else in the graph reads or writes a cache.

    Args:
        query: ``[num_tokens, num_heads * head_size]``.
        key: ``[num_tokens, num_kv_heads * head_size]``.
        value: same shape as ``key``.
        kv_cache_index: the layer's position in the context's ``kv_caches``.

    Returns:
        ``[num_tokens, num_heads * head_size]``.
    """
    ctx = get_forward_context()
    kv_cache = ctx.kv_caches[kv_cache_index]
    num_tokens = query.shape[0]
    backend = get_attn_backend(kv_cache.device)
    backend.write_kv(key.view(num_tokens, num_kv_heads, head_size), value.view(num_tokens, num_kv_heads, head_size),
                     kv_cache, ctx.attn_metadata.slot_mapping)
    out = backend.paged_attention(query.view(num_tokens, num_heads, head_size), kv_cache, ctx.attn_metadata,
                                  scale, sliding_window, logits_soft_cap)
    return out.view(num_tokens, num_heads * head_size)


@unified_attention.register_fake
def _(query, key, value, kv_cache_index, num_heads, num_kv_heads, head_size, scale, sliding_window,
      logits_soft_cap):
    return torch.empty_like(query)


def bind_kv_cache_indices(model: torch.nn.Module, run_forward) -> int:
    """Records in every `Attention` layer of ``model`` the index of the cache it is handed.

    Args:
        model: the model.
        run_forward: runs one eager forward of ``model`` and returns the ``kv_caches`` list it
            passed (the hooks see each layer's cache and look it up there by identity).

    Returns:
        How many layers were bound.

    Raises:
        EngineError: a layer ran with a cache that is not in the list, or did not run at all.
    """
    from ferrollm.attention.layer import Attention

    layers = [m for m in model.modules() if isinstance(m, Attention)]
    seen: dict[int, torch.Tensor] = {}

    def hook(module, args):
        seen[id(module)] = args[3]

    handles = [layer.register_forward_pre_hook(hook) for layer in layers]
    try:
        kv_caches = run_forward()
    finally:
        for h in handles:
            h.remove()
    for layer in layers:
        cache = seen.get(id(layer))
        index = next((i for i, c in enumerate(kv_caches) if c is cache), None)
        if index is None:
            raise EngineError(f"attention layer {layer.extra_repr()} did not run with one of the model's KV caches")
        layer.kv_cache_index = index
    return len(layers)
