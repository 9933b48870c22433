"""Logprob containers, at vLLM's module path (`vllm.logprobs`): `Logprob`, the per-position dict
lists, and `FlatLogprobs`, which keeps a request's logprobs in a few flat lists.

A position holds the chosen (sampled or prompt) token first, then the top-k tokens; when the
chosen token is also in the top-k it appears twice in the flat lists and once in the dict, whose
value is the later (top-k) entry, as in vLLM: its rank is then its top-k position.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableSequence
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Union, overload

__all__ = [
    "FlatLogprobs",
    "Logprob",
    "LogprobsOnePosition",
    "PromptLogprobs",
    "SampleLogprobs",
    "append_logprobs_for_next_position",
    "create_prompt_logprobs",
    "create_sample_logprobs",
]


@dataclass
class Logprob:
    """One token's log probability at one position.

    Args:
        logprob: Log probability of the token (or its logit, per `logprobs_mode`).
        rank: The token's rank at this position (1 = most likely).
        decoded_token: The token's text; None when detokenization is off.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


LogprobsOnePosition = Dict[int, Logprob]


@dataclass
class FlatLogprobs(MutableSequence):  # type: ignore[type-arg]
    """A request's logprobs as flat lists, read like ``list[dict[int, Logprob]]``.

    Position ``i`` owns entries ``start_indices[i]:end_indices[i]`` of `token_ids`, `logprobs`,
    `ranks` and `decoded_tokens`. Indexing a position builds its dict; slicing gives a
    `FlatLogprobs`; the container is append-only (no item assignment, deletion or insertion).
    A request holds a constant number of Python objects whatever its length, which is what makes
    it cheaper than a list of dicts for long outputs.
    """

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, logprobs_one_position: LogprobsOnePosition | None) -> None:
        """Adds the next position from a dict (None or empty adds an empty position)."""
        self.start_indices.append(len(self.logprobs))
        for token_id, lp in (logprobs_one_position or {}).items():
            self._push(token_id, lp.logprob, lp.rank, lp.decoded_token)
        self.end_indices.append(len(self.logprobs))

    def append_fast(self, token_ids: Iterable[int], logprobs: Iterable[float],
                    ranks: Iterable[int | None], decoded_tokens: Iterable[str | None]) -> None:
        """Adds the next position from parallel sequences, without building a dict."""
        self.start_indices.append(len(self.logprobs))
        for entry in zip(token_ids, logprobs, ranks, decoded_tokens):
            self._push(*entry)
        self.end_indices.append(len(self.logprobs))

    def _push(self, token_id: int, logprob: float, rank: int | None, text: str | None) -> None:
        self.token_ids.append(token_id)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        self.decoded_tokens.append(text)

    def extend(self, values: Iterable[LogprobsOnePosition | None]) -> None:
        for position in values:
            self.append(position)

    def __len__(self) -> int:
        return len(self.start_indices)

    @overload
    def __getitem__(self, index: int) -> LogprobsOnePosition: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return self._slice(index)
        if not isinstance(index, int):
            raise TypeError(f"FlatLogprobs indices must be int or slice. Given: {type(index).__name__}")
        start, end = self.start_indices[index], self.end_indices[index]
        return {
            self.token_ids[i]: Logprob(self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
            for i in range(start, end)
        }

    def _slice(self, index: slice) -> FlatLogprobs:
        starts, ends = self.start_indices[index], self.end_indices[index]
        if not starts:
            return FlatLogprobs()
        # Copied position by position, so a slice with a step keeps each position's own entries.
        out = FlatLogprobs()
        for s, e in zip(starts, ends):
            out.start_indices.append(len(out.token_ids))
            for i in range(s, e):
                out._push(self.token_ids[i], self.logprobs[i], self.ranks[i], self.decoded_tokens[i])
            out.end_indices.append(len(out.token_ids))
        return out

    def __iter__(self) -> Iterator[LogprobsOnePosition]:
        for i in range(len(self)):
            yield self[i]

    def __setitem__(self, index: Any, value: Any) -> None:
        raise TypeError("Cannot set logprobs in FlatLogprobs")

    def __delitem__(self, index: Any) -> None:
        raise TypeError("Cannot delete logprobs from FlatLogprobs")

    def insert(self, index: int, value: Any) -> None:
        raise TypeError("Cannot insert logprobs to FlatLogprobs")


# One entry per prompt token; the first is None since nothing predicts it.
PromptLogprobs = Union[FlatLogprobs, List[Optional[LogprobsOnePosition]]]
# One entry per generated token: token id -> its Logprob (the sampled token and the top ones).
SampleLogprobs = Union[FlatLogprobs, List[LogprobsOnePosition]]


def create_prompt_logprobs(flat_logprobs: bool) -> PromptLogprobs:
    """An empty prompt-logprobs container holding the first prompt token's None."""
    container: PromptLogprobs = FlatLogprobs() if flat_logprobs else []
    container.append(None)
    return container


def create_sample_logprobs(flat_logprobs: bool) -> SampleLogprobs:
    """An empty sample-logprobs container."""
    return FlatLogprobs() if flat_logprobs else []


def append_logprobs_for_next_position(container: PromptLogprobs | SampleLogprobs, token_ids: list[int],
                                      logprobs: list[float], decoded_tokens: Iterable[str | None],
                                      rank: int) -> None:
    """Appends one position: the chosen token with its counted `rank`, then the top tokens
    numbered 1..k by position (ties keep distinct ranks).

    Args:
        container: Where to append.
        token_ids: The chosen token, then the top k.
        logprobs: Their values.
        decoded_tokens: Their texts (or Nones).
        rank: The chosen token's rank.
    """
    ranks = [rank, *range(1, len(token_ids))]
    if isinstance(container, FlatLogprobs):
        container.append_fast(token_ids, logprobs, ranks, decoded_tokens)
        return
    # Later entries win: a chosen token that is also in the top k keeps its top-k rank.
    container.append({t: Logprob(lp, r, text)
                      for t, lp, r, text in zip(token_ids, logprobs, ranks, decoded_tokens)})
