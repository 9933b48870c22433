"""The engine core through the bindings, with synthetic sampled tokens."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import reference_tokens, run_engine

from ferrollm import EngineCore, SamplingOptions


def greedy(max_tokens: int, **kw) -> SamplingOptions:
    return SamplingOptions(max_tokens=max_tokens, temperature=0.0, **kw)


def ids(seed: int, n: int) -> list[int]:
    return [(seed * 31 + i * 17) % 250 + 3 for i in range(n)]


def test_prefix_hit_serves_48_shared_tokens_and_ref_counts_blocks_twice():
    engine = EngineCore(block_size=16, num_blocks=64, max_model_len=256)
    shared = ids(9, 48)
    engine.add_requests(["a"], [shared + ids(1, 12)], [greedy(4)])
    step = engine.schedule()
    engine.update(np.array([5], dtype=np.int64))
    engine.add_requests(["b"], [shared + ids(2, 12)], [greedy(4)])
    step = engine.schedule()
    assert step.num_computed_tokens.tolist() == [60, 48]
    a_blocks, b_blocks = engine.block_ids("a"), engine.block_ids("b")
    assert a_blocks[:3] == b_blocks[:3]
    assert a_blocks[3] != b_blocks[3]
    assert [engine.block_ref_count(b) for b in a_blocks[:3]] == [2, 2, 2]
    engine.update(np.array([5, 5], dtype=np.int64))
    outputs, _ = run_engine(engine)
    cached = {o.request_id: o.num_cached_tokens for o in outputs}
    assert cached == {"a": 0, "b": 48}
    stats = engine.stats()
    assert stats["prefix_cache_hit_tokens"] == 48
    assert stats["num_free_blocks"] == 63 and stats["num_running"] == 0


def test_chunked_prefill_splits_the_prompt_and_keeps_the_tokens():
    prompt = ids(3, 100)
    engine = EngineCore(block_size=16, num_blocks=64, max_model_len=256, max_num_batched_tokens=32, max_num_seqs=4)
    engine.add_requests(["a"], [prompt], [greedy(6)])
    outputs, steps = run_engine(engine)
    assert [int(s.num_scheduled_tokens[0]) for s in steps[:4]] == [32, 32, 32, 4]
    assert [bool(s.needs_sample[0]) for s in steps[:4]] == [False, False, False, True]
    assert outputs[0].token_ids == reference_tokens(prompt, 6)


def test_preempted_requests_resume_with_the_same_tokens():
    # 12 usable blocks of 4 tokens cannot hold three requests growing to 30 tokens each.
    engine = EngineCore(block_size=4, num_blocks=13, max_model_len=48, max_num_batched_tokens=64, max_num_seqs=3)
    prompts = [ids(i, 10) for i in range(3)]
    engine.add_requests([f"r{i}" for i in range(3)], prompts, [greedy(20)] * 3)
    outputs, steps = run_engine(engine)
    assert engine.stats()["num_preemptions"] > 0
    assert any(len(s.preempted_req_indices) for s in steps)
    resumed = [s for s in steps if s.cached_resumed.any()]
    assert resumed, "a preempted request is resent with its whole block table"
    by_id = {o.request_id: o for o in outputs}
    for i, p in enumerate(prompts):
        assert by_id[f"r{i}"].token_ids == reference_tokens(p, 20)
        assert by_id[f"r{i}"].finish_reason == "length"


def test_step_arrays_are_numpy_and_consistent():
    engine = EngineCore(block_size=4, num_blocks=64, max_model_len=128)
    engine.add_requests(["a", "b"], [ids(1, 5), ids(2, 9)], [greedy(3), greedy(3)])
    step = engine.schedule()
    assert step.input_ids.dtype == np.int64 and step.block_tables.dtype == np.int32
    assert step.block_tables.shape == (2, 3)
    assert step.query_start_loc.tolist() == [0, 5, 14]
    assert step.logits_indices.tolist() == [4, 13]
    assert step.seq_lens.tolist() == [5, 9]
    table = step.block_tables
    for row, (start, end) in enumerate([(0, 5), (5, 14)]):
        for tok, pos in zip(range(start, end), step.positions[start:end]):
            assert step.slot_mapping[tok] == table[row, pos // 4] * 4 + pos % 4
    # The arrays own the core's buffers (moved, not copied, out of Rust).
    assert not step.input_ids.flags.owndata and step.input_ids.base is not None
    assert [r.request_id for r in step.scheduled_new_reqs] == ["a", "b"]
    assert step.scheduled_new_reqs[1].prompt_token_ids == ids(2, 9)


def test_arrays_wrap_into_torch_without_a_copy():
    torch = pytest.importorskip("torch")
    engine = EngineCore(block_size=4, num_blocks=64, max_model_len=128)
    engine.add_requests(["a"], [ids(1, 5)], [greedy(3)])
    step = engine.schedule()
    t = torch.from_numpy(step.input_ids)
    assert t.data_ptr() == step.input_ids.__array_interface__["data"][0]


def test_new_request_data_is_sent_once_then_only_diffs():
    engine = EngineCore(block_size=4, num_blocks=64, max_model_len=128)
    engine.add_requests(["a"], [ids(1, 6)], [greedy(8)])
    s1 = engine.schedule()
    assert len(s1.scheduled_new_reqs) == 1 and len(s1.cached_req_indices) == 0
    engine.update([7])
    s2 = engine.schedule()
    assert s2.scheduled_new_reqs == [] and s2.cached_req_indices.tolist() == [s1.req_indices[0]]
    assert s2.cached_new_block_offsets.tolist() == [0, 0]


def test_every_request_comes_back_exactly_once_including_aborts():
    engine = EngineCore(block_size=16, num_blocks=64, max_model_len=256)
    engine.add_requests([f"r{i}" for i in range(6)], [ids(i, 8) for i in range(6)], [greedy(30)] * 6)
    engine.update(np.full(len(engine.schedule()), 7, dtype=np.int64))
    assert engine.abort_requests(["r1", "r4", "missing"]) == 2
    outputs, _ = run_engine(engine)
    assert sorted(o.request_id for o in outputs) == [f"r{i}" for i in range(6)]
    reasons = {o.request_id: o.finish_reason for o in outputs}
    assert reasons["r1"] == reasons["r4"] == "abort"
    assert reasons["r0"] == "length"


def test_priority_policy_runs_lowest_value_first():
    engine = EngineCore(block_size=16, num_blocks=64, max_model_len=256, max_num_seqs=1, scheduling_policy="priority")
    engine.add_requests(["low", "high", "mid"], [ids(1, 4)] * 3, [greedy(1)] * 3, priorities=[5, -1, 0])
    outputs, _ = run_engine(engine)
    assert [o.request_id for o in outputs] == ["high", "mid", "low"]


def test_cache_salt_keeps_prefixes_apart():
    engine = EngineCore(block_size=16, num_blocks=64, max_model_len=256)
    p = ids(5, 40)
    engine.add_requests(["a"], [p], [greedy(2)], cache_salts=["tenant-1"])
    run_engine(engine)
    engine.add_requests(["b", "c"], [p, p], [greedy(2)] * 2, cache_salts=["tenant-2", "tenant-1"])
    outputs, _ = run_engine(engine)
    cached = {o.request_id: o.num_cached_tokens for o in outputs}
    assert cached == {"b": 0, "c": 32}


def test_reset_prefix_cache_forgets_prefixes_once_idle():
    engine = EngineCore(block_size=16, num_blocks=64, max_model_len=256)
    p = ids(5, 40)
    engine.add_requests(["a"], [p], [greedy(2)])
    run_engine(engine)
    assert engine.reset_prefix_cache()
    engine.add_requests(["b"], [p], [greedy(2)])
    outputs, _ = run_engine(engine)
    assert outputs[0].num_cached_tokens == 0
