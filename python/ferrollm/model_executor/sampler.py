"""The batched sampler: one step's logits [R, V] -> one token per request, plus logprobs.

Order, as in vLLM v1:
  1. logprobs (when asked) from the raw logits, before anything below changes them;
  2. allowed_token_ids mask, min_tokens stop mask, logit_bias;
  3. penalties: repetition (prompt + output), frequency and presence (output);
  4. greedy rows take the argmax here;
  5. temperature, min_p, top-k / top-p, then a random draw per sampling row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrollm.model_executor import sampling_ops as ops
from ferrollm.model_executor.sampling_metadata import SAMPLING_EPS, SamplingMetadata
from ferrollm.model_executor.sampling_ops import LogprobsTensors

__all__ = ["LogprobsTensors", "Sampler", "SamplerOutput", "compute_prompt_logprobs"]


@dataclass
class SamplerOutput:
    """One step's sampled tokens and, when asked, their logprobs.

    Args:
        sampled_token_ids: int64 [R].
        logprob_token_ids: int64 [R, k+1], the sampled token then the top k; None when no row
            asked for logprobs. Rows that asked for fewer than k use a prefix.
        logprobs: float32 [R, k+1], matching `logprob_token_ids` (raw model logprobs).
        sampled_token_ranks: int64 [R], the sampled token's rank (1 = most likely).
    """

    sampled_token_ids: torch.Tensor
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    sampled_token_ranks: torch.Tensor | None = None


class Sampler:
    """Samples one token per request from one step's logits."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Samples the next token of every row.

        Args:
            logits: [R, V] logits of each request's last position (any float dtype); not
                modified.
            meta: The step's `SamplingMetadata`.

        Returns:
            The `SamplerOutput`.
        """
        # A private float32 copy where a stage below works in place on it. Plain sampling at
        # temperature 1 changes nothing in place: the copy would be a pass over R x V floats.
        logits = logits.to(torch.float32, copy=meta.edits_logits)
        num_logprobs = meta.max_num_logprobs
        # vLLM v1's default ("raw_logprobs"): what the model said, before any processing.
        raw_logprobs = None if num_logprobs is None else logits.log_softmax(dim=-1)
        self._process_logits_(logits, meta)
        sampled = self._sample(logits, meta)
        if num_logprobs is None or raw_logprobs is None:
            return SamplerOutput(sampled)
        lp = ops.gather_logprobs(raw_logprobs, sampled, num_logprobs)
        return SamplerOutput(sampled, lp.logprob_token_ids, lp.logprobs, lp.ranks)

    @staticmethod
    def _process_logits_(logits: torch.Tensor, meta: SamplingMetadata) -> None:
        """The stages that can change the argmax, so greedy rows see them too."""
        if meta.allowed_token_ids_mask is not None:
            logits.masked_fill_(meta.allowed_token_ids_mask, float("-inf"))
        if meta.min_tokens_stop is not None:
            logits[meta.min_tokens_stop] = float("-inf")
        if meta.logit_bias is not None:
            rows, cols, values = meta.logit_bias
            logits.index_put_((rows, cols), values, accumulate=True)
        if not meta.no_penalties:
            ops.apply_penalties_(
                logits, meta.prompt_token_ids, meta.output_token_ids,  # type: ignore[arg-type]
                meta.presence_penalties, meta.frequency_penalties,  # type: ignore[arg-type]
                meta.repetition_penalties,  # type: ignore[arg-type]
            )

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = None if meta.all_random else logits.argmax(dim=-1)
        if meta.all_greedy:
            return greedy  # type: ignore[return-value]
        # Greedy rows divide by 1 so they stay finite; their draw is discarded below.
        temperature = meta.temperature
        if not meta.all_random:
            temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
        if meta.divides_by_temperature:  # x / 1 is x
            logits.div_(temperature.unsqueeze(1))
        if meta.min_p is not None:
            logits = ops.apply_min_p(logits, meta.min_p)
        logits = ops.apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
        drawn = ops.random_sample(logits.softmax(dim=-1), meta.generators)
        if greedy is None:
            return drawn
        return torch.where(meta.temperature < SAMPLING_EPS, greedy, drawn)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor,
                            num_logprobs: int) -> LogprobsTensors:
    """Logprobs of the prompt's own tokens, for `SamplingParams.prompt_logprobs`.

    Args:
        logits: [P, V] raw logits at P prompt positions.
        target_ids: [P] the token that follows each position.
        num_logprobs: How many top entries per position; -1 returns all V.

    Returns:
        `LogprobsTensors`: ids and logprobs [P, k+1] (the prompt token first) and ranks [P].
    """
    logprobs = logits.to(torch.float32).log_softmax(dim=-1)
    return ops.gather_logprobs(logprobs, target_ids.long(), num_logprobs)
