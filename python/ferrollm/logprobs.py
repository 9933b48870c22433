"""Log probabilities as `generate` returns them, at vLLM's module path (`vllm.logprobs`):
`Logprob`, and the per-position layouts `SampleLogprobs` / `PromptLogprobs`.

vLLM's `FlatLogprobs` (the same data in flat lists, `SamplingParams(flat_logprobs=True)`) belongs
here too; issue #27 part B adds it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

__all__ = ["Logprob", "PromptLogprobs", "SampleLogprobs"]


@dataclass
class Logprob:
    """One token's log probability at one position.

    Args:
        logprob: Log probability of the token (from the model's raw logits).
        rank: The token's rank in the vocabulary at this position (1 = most likely).
        decoded_token: The token's text, when detokenization is on.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: token id -> its Logprob (the sampled token and the top ones).
SampleLogprobs = List[Dict[int, Logprob]]
# One entry per prompt token; the first is None since nothing predicts it.
PromptLogprobs = List[Optional[Dict[int, Logprob]]]
