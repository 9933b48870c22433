"""Which attention backend runs a layer: Triton for CUDA tensors, torch for CPU tensors.

``FERROLLM_ATTENTION_BACKEND=TORCH`` forces the torch backend everywhere (useful to bisect a
GPU mismatch); ``TRITON`` forces the Triton one, which on the CPU only works under
``TRITON_INTERPRET=1`` (that is how the tests run the whole model through the kernels).
The Triton backend is imported on first use, so CPU-only installs never need Triton.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Protocol

import torch

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.exceptions import ConfigError

__all__ = ["AttentionBackend", "BACKEND_ENV", "get_attn_backend"]

BACKEND_ENV = "FERROLLM_ATTENTION_BACKEND"
_BACKENDS = ("TORCH", "TRITON")


class AttentionBackend(Protocol):
    """What a backend module provides (see :mod:`ferrollm.attention.cpu_backend`)."""

    NAME: str

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None: ...

    def paged_attention(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
                        scale: float, sliding_window: int | None = None,
                        logits_soft_cap: float | None = None) -> torch.Tensor: ...


def get_attn_backend(device: torch.device | str) -> AttentionBackend:
    """The backend for tensors on ``device``.

    Args:
        device: where the KV cache lives.

    Returns:
        The Triton backend on CUDA, the torch backend elsewhere, unless ``FERROLLM_ATTENTION_BACKEND``
        names one.

    Raises:
        ConfigError: if ``FERROLLM_ATTENTION_BACKEND`` names no backend.
    """
    forced = os.environ.get(BACKEND_ENV, "").strip().upper()
    if forced and forced not in _BACKENDS:
        raise ConfigError(f"`{BACKEND_ENV}` must be one of {list(_BACKENDS)}. Given: {forced!r}")
    name = forced or ("TRITON" if torch.device(device).type == "cuda" else "TORCH")
    return _load(name)


@functools.cache
def _load(name: str) -> ModuleType:
    if name == "TRITON":
        from ferrollm.attention import triton_backend

        return triton_backend
    from ferrollm.attention import cpu_backend

    return cpu_backend
