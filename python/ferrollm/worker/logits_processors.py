"""Custom logits processors on the sampling rank: loading them from `LLM(logits_processors=...)`
and feeding them vLLM v1's batch protocol.

A processor's batch index is the core's request index (`req_index`), fixed for the request's
life, so requests never move: a `BatchUpdate` only lists the indices that finished and the
requests that arrived since the previous step. A step's sampled rows are a subset of those
indices in another order; `RowMapped` scatters them into a `[batch_size, V]` tensor for the
processor and gathers them back (skipped when the rows already are 0..batch_size-1), one extra
copy of the step's logits per processor when they differ.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import torch

from ferrollm.exceptions import ConfigError, InvalidRequestError
from ferrollm.sampling_params import SamplingParams
from ferrollm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor

__all__ = ["LogitsProcessorBatch", "RowMapped", "load_logits_processor_classes", "validate_request"]


def load_logits_processor_classes(specs: Sequence[Any] | None) -> list[type[LogitsProcessor]]:
    """The classes named by `specs`: classes, or "module:Qual.Name" / "module.Name" strings.

    Raises:
        ConfigError: A name does not import, or is not a `LogitsProcessor` subclass.
    """
    classes = []
    for spec in specs or ():
        cls = _import_name(spec) if isinstance(spec, str) else spec
        if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
            raise ConfigError(
                "`logits_processors` entries must be subclasses of "
                "ferrollm.v1.sample.logits_processor.LogitsProcessor (vLLM v1's interface) or their "
                f"qualified names. Given: {spec!r}")
        classes.append(cls)
    return classes


def _import_name(name: str) -> Any:
    module_name, sep, qualname = name.partition(":")
    if not sep:
        module_name, _, qualname = name.rpartition(".")
    try:
        obj: Any = importlib.import_module(module_name)
        for attr in qualname.split("."):
            obj = getattr(obj, attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise ConfigError(f"`logits_processors`: could not load {name!r} ('module:Class' or 'module.Class'): {e}") from e
    return obj


def validate_request(classes: Sequence[type[LogitsProcessor]], params: SamplingParams) -> None:
    """Runs each class's `validate_params` on a request; a `ValueError` refuses it."""
    for cls in classes:
        try:
            cls.validate_params(params)
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise InvalidRequestError(f"logits processor {cls.__name__} refused the request: {e}") from e


class LogitsProcessorBatch:
    """The engine's processor instances and the batch they have been told about.

    Args:
        processors: Built instances, in the order they run.
    """

    def __init__(self, processors: list[LogitsProcessor]):
        self.processors = processors
        self._shown: set[int] = set()  # indices the processors hold a request for
        self._removed: set[int] = set()
        self._added: dict[int, tuple[int, SamplingParams, list[int] | None, list[int]]] = {}
        self.active: list[RowMapped] = []

    def remove(self, index: int) -> None:
        """Forgets the request at `index` (finished or aborted)."""
        self._added.pop(index, None)  # joined and left between two steps: never shown
        if index in self._shown:
            self._removed.add(index)

    def add(self, index: int, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
        """Registers a new request; `output_ids` is its live list of generated tokens."""
        self._added[index] = (index, params, prompt_ids, output_ids)

    def begin_step(self, row_indices: Sequence[int]) -> None:
        """Sends the pending batch update (or None) to every processor and maps this step's
        sampled rows (their request indices, in row order) for `apply`."""
        update = None
        if self._removed or self._added:
            self._shown = (self._shown - self._removed) | set(self._added)
            # An index a new request took is listed as added only: it replaces the old one.
            removed = sorted(self._removed - set(self._added))
            update = BatchUpdate(self.batch_size, removed, list(self._added.values()), [])
            self._removed, self._added = set(), {}
        for p in self.processors:
            p.update_state(update)
        rows = list(row_indices)
        self.active = [RowMapped(p, rows, self.batch_size) for p in self.processors]

    @property
    def batch_size(self) -> int:
        return max(self._shown, default=-1) + 1


class RowMapped:
    """One processor seen by the sampler: `apply` takes the step's rows, the processor sees
    rows by batch index."""

    def __init__(self, processor: LogitsProcessor, rows: list[int], batch_size: int):
        self.processor = processor
        self.rows = rows
        self.batch_size = batch_size

    def is_argmax_invariant(self) -> bool:
        return self.processor.is_argmax_invariant()

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if self.rows == list(range(self.batch_size)):
            return self.processor.apply(logits)
        index = torch.tensor(self.rows, device=logits.device)
        full = logits.new_zeros(self.batch_size, logits.shape[1])
        full[index] = logits
        return self.processor.apply(full)[index]
