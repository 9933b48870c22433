"""Helpers vLLM's example processors import from `vllm.v1.sample.logits_processor.builtin`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

from ferrollm.v1.sample.logits_processor.interface import (
    BatchUpdate,
    MoveDirectionality,
)

if TYPE_CHECKING:
    from ferrollm.sampling_params import SamplingParams

__all__ = ["process_dict_updates"]

T = TypeVar("T")


def process_dict_updates(req_entries: dict[int, T], batch_update: BatchUpdate | None,
                         new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None]) -> bool:
    """Applies a `BatchUpdate` to a processor's per-index state (removed, added, moved, in
    that order of meaning: an added request replaces whatever held its index).

    Args:
        req_entries: Batch index -> the processor's state for that request, changed in place.
        batch_update: The update, or None (nothing changes).
        new_state: (params, prompt ids, output ids) -> the state of a new request, or None when
            the processor does not apply to it.

    Returns:
        Whether `req_entries` changed.
    """
    if not batch_update:
        return False
    changed = False
    for index, params, prompt_ids, output_ids in batch_update.added:
        state = new_state(params, prompt_ids, output_ids)
        if state is not None:
            req_entries[index] = state
            changed = True
        elif req_entries.pop(index, None) is not None:
            changed = True
    for index in batch_update.removed:
        # An index re-used by an added request keeps the new request's state.
        if index not in {a[0] for a in batch_update.added} and req_entries.pop(index, None) is not None:
            changed = True
    for a, b, direction in batch_update.moved:
        a_state, b_state = req_entries.pop(a, None), req_entries.pop(b, None)
        if a_state is not None:
            req_entries[b] = a_state
        if b_state is not None and direction == MoveDirectionality.SWAP:
            req_entries[a] = b_state
        changed = changed or a_state is not None or b_state is not None
    return changed
