"""The multimodal input cache: an image's or a video's processed tensors kept by a content
hash, so a repeated item skips its preprocessing. The store is the Rust core's byte-bounded LRU
(`ferrollm._core.MultiModalCache`); this module hashes items and turns tensors into the bytes
and metadata the store keeps.

Its size: the `mm_processor_cache_gb` argument of `LLM`, else ``FERROLLM_MM_INPUT_CACHE_GIB``
(``VLLM_MM_INPUT_CACHE_GIB`` accepted), else 4 GiB; 0 disables it.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import numpy as np
import torch

from ferrollm._core import MultiModalCache
from ferrollm.exceptions import ConfigError

__all__ = ["MultiModalInputCache", "cache_capacity_bytes", "hash_item"]

DEFAULT_CACHE_GIB = 4.0
ENV_VARS = ("FERROLLM_MM_INPUT_CACHE_GIB", "VLLM_MM_INPUT_CACHE_GIB")


def cache_capacity_bytes(mm_processor_cache_gb: float | None) -> int:
    """The cache's byte bound from the `LLM` argument, the environment or the default."""
    value: Any = mm_processor_cache_gb
    name = "mm_processor_cache_gb"
    if value is None:
        for var in ENV_VARS:
            if os.environ.get(var):
                value, name = os.environ[var], var
                break
        else:
            value = DEFAULT_CACHE_GIB
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if gib < 0:
        raise ConfigError(f"`{name}` must be a number of GiB >= 0. Given: {value!r}")
    return int(gib * (1 << 30))


def hash_item(modality: str, item: Any, kwargs: dict[str, Any]) -> str:
    """A hex digest of an item's content and the processor options applied to it. An item is a
    PIL image (pixels and mode), an array or tensor (bytes, dtype and shape), a list or tuple of
    those (a video's frames, each hashed in order) or a dict (a video's metadata)."""
    h = hashlib.blake2b(digest_size=20)
    h.update(modality.encode())
    h.update(json.dumps(kwargs, sort_keys=True, default=str).encode())
    _update(h, item)
    return h.hexdigest()


def _update(h: Any, item: Any) -> None:
    if hasattr(item, "tobytes") and hasattr(item, "mode"):  # a PIL image
        h.update(f"pil:{item.mode}:{item.size}".encode())
        h.update(item.tobytes())
    elif isinstance(item, (list, tuple)):
        # The length and a separator per element, so [a, b] and [ab] never collide.
        h.update(f"seq:{len(item)}".encode())
        for element in item:
            _update(h, element)
            h.update(b"|")
    elif isinstance(item, dict):
        h.update(b"dict:" + json.dumps(item, sort_keys=True, default=str).encode())
    else:
        arr = np.ascontiguousarray(item.numpy() if isinstance(item, torch.Tensor) else np.asarray(item))
        h.update(f"array:{arr.dtype}:{arr.shape}".encode())
        h.update(arr.tobytes())


class MultiModalInputCache:
    """Processed items by identifier, stored in the core's LRU.

    Args:
        capacity_bytes: the bound (0 disables the cache: `get` always misses, `put` stores nothing).
    """

    def __init__(self, capacity_bytes: int):
        self.store = MultiModalCache(capacity_bytes)

    def get(self, identifier: str) -> tuple[torch.Tensor, tuple[int, int, int]] | None:
        """The pixel values and grid stored for ``identifier``, or None."""
        entry = self.get_entry(identifier)
        return None if entry is None else (entry[0], entry[1])

    def get_entry(self, identifier: str) -> tuple[torch.Tensor, tuple[int, int, int], dict[str, Any]] | None:
        """The pixel values, grid and extra values (see `put`) stored for ``identifier``, or None."""
        if self.store.capacity_bytes == 0:
            return None
        found = self.store.get(identifier)
        if found is None:
            return None
        data, meta = found
        info = json.loads(meta)
        arr = np.frombuffer(data, dtype=np.dtype(info["dtype"])).reshape(info["shape"])
        # frombuffer views immutable bytes: copy so torch gets a writable tensor.
        return torch.from_numpy(arr.copy()), tuple(info["grid"]), info.get("extra", {})  # type: ignore[return-value]

    def put(self, identifier: str, pixel_values: torch.Tensor, grid: tuple[int, int, int],
            extra: dict[str, Any] | None = None) -> None:
        """Stores an item; ``extra`` holds JSON values that came with it (a video's
        ``second_per_grid_t``)."""
        if self.store.capacity_bytes == 0:
            return
        arr = pixel_values.detach().cpu().contiguous().numpy()
        meta = json.dumps({"dtype": arr.dtype.str, "shape": list(arr.shape), "grid": list(grid), "extra": extra or {}})
        self.store.put(identifier, arr.tobytes(), meta)

    def stats(self) -> dict[str, int]:
        """num_hits, num_misses, num_evictions, num_entries, num_bytes, capacity_bytes."""
        return dict(self.store.stats())
