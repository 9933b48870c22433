"""Custom logits processors at vLLM v1's path (`vllm.v1.sample.logits_processor`): the base
class, the batch-update types, and `AdapterLogitsProcessor`, which wraps per-request callables
into a batch-level processor. `LLM(logits_processors=[...])` takes subclasses or their names."""

from __future__ import annotations

import inspect
from abc import abstractmethod
from functools import partial
from typing import TYPE_CHECKING, Any

from ferrollm.logits_process import LogitsProcessor as RequestLogitsProcessor
from ferrollm.v1.sample.logits_processor.builtin import process_dict_updates
from ferrollm.v1.sample.logits_processor.interface import (
    BatchUpdate,
    LogitsProcessor,
    MoveDirectionality,
)

if TYPE_CHECKING:
    import torch

    from ferrollm.sampling_params import SamplingParams

__all__ = [
    "STR_POOLING_REJECTS_LOGITSPROCS",
    "AdapterLogitsProcessor",
    "BatchUpdate",
    "LogitsProcessor",
    "MoveDirectionality",
    "RequestLogitsProcessor",
]

# vLLM's message when a pooling model is given custom logits processors.
STR_POOLING_REJECTS_LOGITSPROCS = "Pooling models do not support custom logits processors."


class AdapterLogitsProcessor(LogitsProcessor):
    """A batch-level processor made of per-request callables.

    Subclasses implement `is_argmax_invariant()` and `new_req_logits_processor(params)`, which
    returns a callable `(output_ids, logits_row)` or `(prompt_ids, output_ids, logits_row)`, or
    None where the request does not use it. A subclass that overrides `__init__` calls this one.
    """

    def __init__(self, vllm_config: Any, device: torch.device, is_pin_memory: bool):
        # Batch index -> the request's callable with its token lists bound (live references).
        self.req_info: dict[int, partial[torch.Tensor]] = {}

    @abstractmethod
    def new_req_logits_processor(self, params: SamplingParams) -> RequestLogitsProcessor | None:
        """The request's own processor, or None when it does not apply."""
        raise NotImplementedError

    def _new_state(self, params: SamplingParams, prompt_ids: list[int] | None,
                   output_ids: list[int]) -> partial[torch.Tensor] | None:
        req_lp = self.new_req_logits_processor(params)
        if req_lp is None:
            return None
        if len(inspect.signature(req_lp).parameters) == 3:
            if prompt_ids is None:
                raise ValueError("this logits processor needs the prompt token ids, which were not given")
            return partial(req_lp, prompt_ids, output_ids)
        return partial(req_lp, output_ids)

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        process_dict_updates(self.req_info, batch_update, self._new_state)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for index, req_lp in self.req_info.items():
            row = logits[index]
            new_row = req_lp(row)
            if new_row is not row:
                logits[index] = new_row
        return logits
