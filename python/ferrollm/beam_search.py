"""Beam search's data, under vLLM's names: `BeamSearchSequence`, `BeamSearchOutput` (what
`LLM.beam_search` returns, one per prompt), `BeamSearchInstance` (one prompt's beams while the
search runs) and the length-penalised score both vLLM and transformers rank finished beams by."""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

from ferrollm.logprobs import Logprob

__all__ = [
    "BeamSearchInstance",
    "BeamSearchOutput",
    "BeamSearchSequence",
    "create_sort_beams_key_function",
    "get_beam_search_score",
]


@dataclass
class BeamSearchSequence:
    """One beam.

    Args:
        tokens: The prompt's token ids followed by the beam's generated ones.
        logprobs: Per generated token, the logprob entries of the step that chose it.
        cum_logprob: Sum of the generated tokens' logprobs.
        text: The decoded `tokens` (prompt included), filled for returned beams.
        finish_reason: Set only when the search was aborted.
        stop_reason: Always None (beam search has no stop strings).
        orig_prompt: The prompt as given.
    """

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    orig_prompt: Any = None
    lora_request: Any = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """One prompt's live beams and its finished ones.

    Args:
        prompt_token_ids: The prompt.
        orig_prompt: The prompt as the caller gave it.
    """

    def __init__(self, prompt_token_ids: list[int], orig_prompt: Any = None):
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids), orig_prompt=orig_prompt)]
        self.completed: list[BeamSearchSequence] = []


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_ids: Collection[int] | int,
                          length_penalty: float = 1.0) -> float:
    """`cumulative_logprob / length ** length_penalty`, the length counting the prompt and not a
    final EOS token (as vLLM scores beams).

    Args:
        tokens: The beam's tokens, prompt included.
        cumulative_logprob: The beam's summed logprobs.
        eos_token_ids: The EOS id, or the set of them.
        length_penalty: The exponent.
    """
    eos = {eos_token_ids} if isinstance(eos_token_ids, int) else eos_token_ids
    length = len(tokens) - (1 if tokens and tokens[-1] in eos else 0)
    return cumulative_logprob / (max(length, 1) ** length_penalty)


def create_sort_beams_key_function(eos_token_ids: Collection[int] | int,
                                   length_penalty: float) -> Callable[[BeamSearchSequence], float]:
    """A sort key for beams: their `get_beam_search_score`."""
    return lambda beam: get_beam_search_score(beam.tokens, beam.cum_logprob, eos_token_ids, length_penalty)
