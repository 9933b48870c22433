"""The multimodal input cache (the core's byte-bounded LRU, through the bindings) and the
multimodal features `EngineCore.add_requests` takes."""

from __future__ import annotations

import ferrollm
import numpy as np
import pytest
import torch
from ferrollm._core import EngineCore, MultiModalCache, SamplingOptions
from ferrollm.exceptions import ConfigError, InvalidRequestError
from ferrollm.multimodal.cache import (
    MultiModalInputCache,
    cache_capacity_bytes,
    hash_item,
)


def test_cache_round_trips_bytes_and_metadata():
    cache = MultiModalCache(1000)
    assert cache.put("k", b"abc", "meta")
    assert cache.get("k") == (b"abc", "meta")
    assert cache.get("missing") is None
    stats = cache.stats()
    assert (stats["num_hits"], stats["num_misses"], stats["num_bytes"]) == (1, 1, 3 + 4 + 1)


def test_cache_evicts_least_recently_used_within_its_bytes():
    cache = MultiModalCache(250)
    for key in "abc":
        cache.put(key, bytes(100), "")
        assert cache.stats()["num_bytes"] <= 250
    assert not cache.contains("a") and cache.contains("c")
    assert not cache.put("huge", bytes(300), "")


def test_tensor_cache_returns_what_was_stored():
    cache = MultiModalInputCache(1 << 20)
    pixels = torch.randn(8, 12)
    cache.put("id", pixels, (1, 2, 4))
    got, grid = cache.get("id")
    assert torch.equal(got, pixels) and grid == (1, 2, 4)
    assert MultiModalInputCache(0).get("id") is None


def test_capacity_reads_argument_then_environment(monkeypatch):
    monkeypatch.delenv("FERROLLM_MM_INPUT_CACHE_GIB", raising=False)
    monkeypatch.setenv("VLLM_MM_INPUT_CACHE_GIB", "0.5")
    assert cache_capacity_bytes(None) == 1 << 29
    assert cache_capacity_bytes(1) == 1 << 30
    monkeypatch.setenv("FERROLLM_MM_INPUT_CACHE_GIB", "0")
    assert cache_capacity_bytes(None) == 0
    with pytest.raises(ConfigError, match="mm_processor_cache_gb"):
        cache_capacity_bytes(-1)


def test_hash_depends_on_pixels_and_processor_kwargs():
    a = np.zeros((4, 4, 3), dtype=np.uint8)
    b = a.copy()
    b[0, 0, 0] = 1
    assert hash_item("image", a, {}) == hash_item("image", a.copy(), {})
    assert hash_item("image", a, {}) != hash_item("image", b, {})
    assert hash_item("image", a, {}) != hash_item("image", a, {"max_pixels": 100})


def test_mm_features_must_lie_inside_the_prompt(tokenizer: ferrollm.Tokenizer):
    core = EngineCore(tokenizer=tokenizer, num_blocks=64, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError, match="mm_features"):
        core.add_requests(["r"], [[5, 6, 7]], [SamplingOptions(max_tokens=1)], mm_features=[[("img", 2, 5)]])
    core.add_requests(["r"], [[5, 6, 7, 8]], [SamplingOptions(max_tokens=1)], mm_features=[[("img", 1, 3)]])
    assert core.has_unfinished_requests()
