"""vLLM v1's batch-level logits processor interface (`vllm.v1.sample.logits_processor.interface`).

A processor is built once per engine, on the rank that samples, with
`(vllm_config, device, is_pin_memory)`. Before each step it gets `update_state(batch_update)`:
None when no request joined or left since the last call, else the `BatchUpdate` of indices
removed, added (with the request's `SamplingParams`, prompt ids and a live reference to its
output ids) and moved, to be applied in that order. `apply(logits)` then gets the step's logits
with one row per batch index and returns them (in place or new). A processor that cannot change
the argmax (`is_argmax_invariant()`) is skipped for greedy requests and runs after temperature.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from ferrollm.sampling_params import SamplingParams

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest", "RemovedRequest"]


class MoveDirectionality(Enum):
    """How a moved request relates the two indices."""

    UNIDIRECTIONAL = auto()  # index a's request now sits at b
    SWAP = auto()  # a and b exchanged their requests


# The batch index a finished request left.
RemovedRequest = int
# (index, params, prompt token ids, the request's live output token ids).
AddedRequest = tuple[int, "SamplingParams", "list[int] | None", "list[int]"]
# (index a, index b, directionality).
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the processor's previous `update_state`.

    Args:
        batch_size: Rows of the logits `apply` gets (every index below it is a row).
        removed: Indices whose requests left.
        added: Requests that joined; an index may replace one just removed.
        moved: Requests that changed index (ferrollm keeps indices fixed: always empty).
    """

    batch_size: int
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """Base class of custom batch-level logits processors, as vLLM v1 defines it."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raises `ValueError` when a request's parameters (its `extra_args`) are invalid for
        this processor; called when the request is added."""
        return

    @abstractmethod
    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Returns the batch's logits, changed (in place or not)."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when the processor can never change which token is likeliest."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called before every step; `batch_update` is None when the batch did not change."""
        raise NotImplementedError
