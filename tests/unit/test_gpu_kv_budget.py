"""The GPU KV-cache budget (worker/gpu_profiler.py) and its start-up error, without a GPU: the
arithmetic over a rank's profiled memory, and the message that names the largest length that fits
and the GPU's options."""

from __future__ import annotations

import pytest
import torch

from ferrollm.engine.kv_memory import gpu_budget_hint, num_kv_blocks
from ferrollm.exceptions import KVCacheTooSmallError
from ferrollm.worker.gpu_profiler import MemoryProfile, prefill_batch

MIB = 1 << 20


def test_the_cache_gets_utilization_of_the_device_less_everything_else():
    p = MemoryProfile(total=1000 * MIB, in_use=100 * MIB, activation_peak=50 * MIB, graphs=20 * MIB,
                      non_torch=30 * MIB)
    assert p.kv_cache_budget(0.9) == 900 * MIB - 200 * MIB
    assert p.kv_cache_budget(0.1) == 0  # never negative
    assert "KV cache budget 700.0 MiB" in p.describe(0.9)


def test_a_gpu_budget_too_small_names_the_largest_length_and_gpu_memory_utilization():
    with pytest.raises(KVCacheTooSmallError) as info:
        num_kv_blocks(budget_bytes=11 * 4096, block_bytes=4096, block_size=16, max_model_len=1024, max_num_seqs=8,
                      budget_hint=gpu_budget_hint(0.5))
    message = str(info.value)
    assert "the largest `max_model_len` that fits is 160" in message
    assert "raise `gpu_memory_utilization` (now 0.5)" in message and "`max_num_batched_tokens`" in message


def test_the_profile_batch_splits_the_tokens_over_the_requests():
    ids, positions, meta = prefill_batch(10, 4, 16, torch.device("cpu"))
    assert meta.query_start_loc.tolist() == [0, 3, 6, 8, 10] and meta.seq_lens.tolist() == [3, 3, 2, 2]
    assert positions.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1]
    assert (meta.slot_mapping == -1).all() and meta.max_query_len == 3 and ids.shape == (10,)
