"""The shared-memory step channel as Python sees it: rank 0's core publishes every step it
schedules, and a receiver gets back the same `SchedulerOutput`, arrays and new requests."""

from __future__ import annotations

import numpy as np
import pytest

import ferrollm
from ferrollm._core import StepBroadcaster, StepReceiver
from ferrollm.exceptions import StepChannelError

ARRAYS = ["req_indices", "num_scheduled_tokens", "input_ids", "positions", "slot_mapping", "block_tables",
          "query_start_loc", "seq_lens", "num_computed_tokens", "logits_indices", "needs_sample",
          "temperature", "top_p", "top_k", "min_p", "seeds", "cached_req_indices", "cached_new_block_ids",
          "cached_new_block_offsets", "finished_req_indices", "preempted_req_indices"]


def test_receiver_gets_every_scheduled_step():
    core = ferrollm.EngineCore(block_size=4, num_blocks=64, max_num_batched_tokens=16, max_num_seqs=8,
                               max_model_len=64)
    tx = StepBroadcaster(1, timeout_s=5.0)
    rx = StepReceiver(tx.path, 0)
    core.set_step_broadcaster(tx)
    params = [ferrollm.SamplingOptions(max_tokens=3, prompt_logprobs=2, seed=7, stop=["x"]),
              ferrollm.SamplingOptions(max_tokens=5)]
    core.add_requests(["a", "b"], [list(range(3, 30)), [5, 6, 7]], params)
    num_steps = 0
    while core.has_unfinished_requests():
        step = core.schedule()
        got = rx.recv(5.0)
        assert isinstance(got, ferrollm.SchedulerOutput)
        assert (got.step_id, len(got), got.total_num_scheduled_tokens) == (step.step_id, len(step), step.total_num_scheduled_tokens)
        for name in ARRAYS:
            np.testing.assert_array_equal(getattr(got, name), getattr(step, name), err_msg=name)
            assert getattr(got, name).dtype == getattr(step, name).dtype, name
        for mine, theirs in zip(step.scheduled_new_reqs, got.scheduled_new_reqs, strict=True):
            assert (theirs.request_id, theirs.req_index, theirs.prompt_token_ids, theirs.block_ids) == \
                (mine.request_id, mine.req_index, mine.prompt_token_ids, mine.block_ids)
            assert repr(theirs.sampling) == repr(mine.sampling)
        core.update(np.full(len(step), 9, dtype=np.int64))
        num_steps += 1
    assert num_steps > 2  # chunked prefill, then decodes
    tx.publish_control()
    assert rx.recv(5.0) == "control"
    tx.publish_shutdown()
    assert rx.recv(5.0) == "shutdown"
    assert rx.recv(0.01) is None


def test_an_aborted_channel_fails_both_ends():
    tx = StepBroadcaster(1, timeout_s=5.0)
    rx = StepReceiver(tx.path, 0)
    tx.abort()
    with pytest.raises(StepChannelError, match="aborted"):
        rx.recv(1.0)
    with pytest.raises(StepChannelError, match="aborted"):
        tx.publish_control()
