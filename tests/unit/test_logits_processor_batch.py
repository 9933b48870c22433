"""The runner's side of vLLM v1's logits processor protocol: batch updates keyed by the core's
request index, and the step's rows mapped to those indices."""

from __future__ import annotations

import torch

from ferrollm.sampling_params import SamplingParams
from ferrollm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from ferrollm.worker.logits_processors import LogitsProcessorBatch


class Recorder(LogitsProcessor):
    def __init__(self, vllm_config=None, device=None, is_pin_memory=False):
        self.updates: list[BatchUpdate | None] = []
        self.seen: torch.Tensor | None = None

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update):
        self.updates.append(batch_update)

    def apply(self, logits):
        self.seen = logits.clone()
        return logits + torch.arange(logits.shape[0]).unsqueeze(1) * 100.0


def test_updates_list_arrivals_and_departures_once_and_none_otherwise():
    rec = Recorder()
    batch = LogitsProcessorBatch([rec])
    p, out = SamplingParams(), [7]
    batch.add(0, p, [1], out)
    batch.add(2, p, [1], [])
    batch.begin_step([0, 2])
    first = rec.updates[-1]
    assert first.batch_size == 3 and [a[0] for a in first.added] == [0, 2] and not first.removed
    assert first.added[0][3] is out, "the live output list is passed by reference"
    batch.begin_step([2, 0])
    assert rec.updates[-1] is None
    batch.remove(2)
    batch.add(2, p, [1], [])  # the index is re-used by a new request
    batch.remove(0)
    batch.begin_step([2])
    upd = rec.updates[-1]
    assert upd.removed == [0] and [a[0] for a in upd.added] == [2] and upd.batch_size == 3


def test_a_request_that_joins_and_leaves_between_steps_is_never_shown():
    rec = Recorder()
    batch = LogitsProcessorBatch([rec])
    batch.add(1, SamplingParams(), [1], [])
    batch.remove(1)
    batch.begin_step([])
    assert rec.updates[-1] is None or not (rec.updates[-1].added or rec.updates[-1].removed)


def test_rows_are_scattered_to_their_indices_and_gathered_back():
    rec = Recorder()
    batch = LogitsProcessorBatch([rec])
    for i in range(3):
        batch.add(i, SamplingParams(), [1], [])
    batch.begin_step([2, 0])
    logits = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    out = batch.active[0].apply(logits)
    assert rec.seen is not None and rec.seen.shape == (3, 2)
    assert torch.equal(rec.seen[2], logits[0]) and torch.equal(rec.seen[0], logits[1])
    assert torch.equal(out, torch.tensor([[201.0, 202.0], [3.0, 4.0]]))
