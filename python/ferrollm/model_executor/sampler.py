"""The batched sampler: one step's logits [R, V] -> one token per request, plus logprobs.

Order, as in vLLM v1:
  1. logprobs (when asked) from the raw logits, before anything below changes them;
  2. allowed_token_ids mask, bad words, min_tokens stop mask, logit_bias, custom logits
     processors that can change the argmax;
  3. penalties: repetition (prompt + output), frequency and presence (output);
  4. greedy rows take the argmax here;
  5. temperature, min_p, argmax-invariant custom processors, top-k / top-p, then a random draw
     per sampling row.

`logprobs_mode` picks what the returned logprobs are, as vLLM's option of that name:
"raw_logprobs" (log-softmax of the model's logits, the default), "raw_logits" (the logits
themselves), "processed_logprobs" / "processed_logits" (the same after every stage above that
changes them: masks, penalties and, for sampling rows, temperature and the top-k / top-p / min-p
filters, whose dropped tokens are -inf). Ranks count tokens at least as large in those values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrollm.model_executor import sampling_ops as ops
from ferrollm.model_executor.sampling_metadata import SAMPLING_EPS, SamplingMetadata
from ferrollm.model_executor.sampling_ops import LogprobsTensors

__all__ = ["LOGPROBS_MODES", "LogprobsTensors", "Sampler", "SamplerOutput", "compute_prompt_logprobs"]

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")


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
    """Samples one token per request from one step's logits.

    Args:
        logprobs_mode: What the returned logprobs hold (one of `LOGPROBS_MODES`).
    """

    def __init__(self, logprobs_mode: str = "raw_logprobs"):
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Samples the next token of every row.

        Args:
            logits: [R, V] logits of each request's last position (any float dtype); not
                modified.
            meta: The step's `SamplingMetadata`.

        Returns:
            The `SamplerOutput`.
        """
        num_logprobs = meta.max_num_logprobs
        mode = self.logprobs_mode if num_logprobs is not None else None
        processed = mode is not None and mode.startswith("processed")
        # A private float32 copy where a stage below works in place on it (or the processed
        # values are returned). Plain sampling at temperature 1 changes nothing in place: the
        # copy would be a pass over R x V floats.
        if meta.edits_logits or processed or logits.dtype != torch.float32:
            logits = logits.to(torch.float32, copy=True)
        # Raw modes: what the model said, before any processing (vLLM v1's default).
        values = _as_mode(logits, mode) if mode is not None and not processed else None
        logits = self._process_logits_(logits, meta)
        sampled, final = self._sample(logits, meta)
        if num_logprobs is None:
            return SamplerOutput(sampled)
        if processed:
            values = _as_mode(final, mode)
        assert values is not None
        lp = ops.gather_logprobs(values, sampled, num_logprobs)
        return SamplerOutput(sampled, lp.logprob_token_ids, lp.logprobs, lp.ranks)

    @staticmethod
    def _process_logits_(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """The stages that can change the argmax, so greedy rows see them too."""
        if meta.allowed_token_ids_mask is not None:
            logits.masked_fill_(meta.allowed_token_ids_mask, float("-inf"))
        if meta.bad_words is not None:
            logits[meta.bad_words] = float("-inf")
        if meta.min_tokens_stop is not None:
            logits[meta.min_tokens_stop] = float("-inf")
        if meta.logit_bias is not None:
            rows, cols, values = meta.logit_bias
            logits.index_put_((rows, cols), values, accumulate=True)
        # vLLM runs its built-in processors (logit bias, min tokens) before custom ones.
        for processor in meta.logits_processors:
            if not processor.is_argmax_invariant():
                logits = processor.apply(logits)
        if not meta.no_penalties:
            ops.apply_penalties_(
                logits, meta.prompt_token_ids, meta.output_token_ids,  # type: ignore[arg-type]
                meta.presence_penalties, meta.frequency_penalties,  # type: ignore[arg-type]
                meta.repetition_penalties,  # type: ignore[arg-type]
            )
        return logits

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """The sampled tokens, and the logits they were drawn from (after the filters)."""
        greedy = None if meta.all_random else ops.greedy_sample(logits)
        if meta.all_greedy:
            return greedy, logits  # type: ignore[return-value]
        # Greedy rows divide by 1 so they stay finite; their draw is discarded below.
        temperature = meta.temperature
        if not meta.all_random:
            temperature = torch.where(temperature < SAMPLING_EPS, 1.0, temperature)
        if meta.divides_by_temperature:  # x / 1 is x
            logits.div_(temperature.unsqueeze(1))
        if meta.min_p is not None:
            logits = ops.apply_min_p(logits, meta.min_p)
        for processor in meta.logits_processors:
            if processor.is_argmax_invariant():
                logits = processor.apply(logits)
        logits = ops.apply_top_k_top_p(logits, meta.top_k, meta.max_top_k, meta.top_p)
        drawn = ops.sample_logits(logits, meta.generators)
        if greedy is None:
            return drawn, logits
        return torch.where(meta.temperature < SAMPLING_EPS, greedy, drawn), logits


def _as_mode(logits: torch.Tensor, mode: str) -> torch.Tensor:
    """The returned values in `mode`: log-softmax for the *_logprobs modes, else a float32
    copy of the logits (later stages write into the sampler's own copy)."""
    if mode.endswith("logprobs"):
        return logits.to(torch.float32).log_softmax(dim=-1)
    return logits.to(torch.float32, copy=True)


def compute_prompt_logprobs(logits: torch.Tensor, target_ids: torch.Tensor, num_logprobs: int,
                            logprobs_mode: str = "raw_logprobs") -> LogprobsTensors:
    """Logprobs of the prompt's own tokens, for `SamplingParams.prompt_logprobs`.

    Nothing processes a prompt's logits, so the processed modes equal the raw ones (as in vLLM).

    Args:
        logits: [P, V] raw logits at P prompt positions.
        target_ids: [P] the token that follows each position.
        num_logprobs: How many top entries per position; -1 returns all V.
        logprobs_mode: Logits for the *_logits modes, else log-softmax.

    Returns:
        `LogprobsTensors`: ids and values [P, k+1] (the prompt token first) and ranks [P].
    """
    return ops.gather_logprobs(_as_mode(logits, logprobs_mode), target_ids.long(), num_logprobs)
