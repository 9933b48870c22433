"""What `LLM.generate` returns: vLLM's `RequestOutput`, `CompletionOutput` and `Logprob`, with
the same field names, so scripts written against vLLM read them unchanged."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Sequence
from typing import Any, Dict, List, Optional

__all__ = ["CompletionOutput", "Logprob", "PromptLogprobs", "RequestOutput", "SampleLogprobs"]


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


@dataclass
class CompletionOutput:
    """One generated sequence of a request.

    Args:
        index: Position of this output among the request's `n` outputs.
        text: The generated text.
        token_ids: The generated token ids.
        cumulative_logprob: Sum of the sampled tokens' log probabilities, when logprobs are
            requested; else None.
        logprobs: Per generated token, the requested top log probabilities; else None.
        finish_reason: "stop" or "length" once finished; None while running.
        stop_reason: The stop string or stop token id that ended it; None for EOS or length.
    """

    index: int
    text: str
    token_ids: Sequence[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    lora_request: Any = None

    def finished(self) -> bool:
        """Whether this sequence has finished.

        Returns:
            True once `finish_reason` is set.
        """
        return self.finish_reason is not None

    def __repr__(self) -> str:
        return (
            f"CompletionOutput(index={self.index}, text={self.text!r}, "
            f"token_ids={list(self.token_ids)}, cumulative_logprob={self.cumulative_logprob}, "
            f"logprobs={self.logprobs}, finish_reason={self.finish_reason}, "
            f"stop_reason={self.stop_reason!r})"
        )


class RequestOutput:
    """Everything returned for one prompt.

    Args:
        request_id: The request's id.
        prompt: The prompt text, when the prompt was given as text.
        prompt_token_ids: The prompt's token ids.
        prompt_logprobs: Per prompt token, the requested log probabilities; else None.
        outputs: The request's `n` generated sequences.
        finished: Whether every sequence has finished.
        metrics: Timing metrics, when collected.
        lora_request: The LoRA adapter used, if any.
        num_cached_tokens: Prompt tokens served from the prefix cache.
        **kwargs: Ignored, so code written for newer vLLM versions still constructs one.
    """

    def __init__(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int] | None,
        prompt_logprobs: PromptLogprobs | None,
        outputs: list[CompletionOutput],
        finished: bool,
        metrics: Any = None,
        lora_request: Any = None,
        num_cached_tokens: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.prompt_logprobs = prompt_logprobs
        self.outputs = outputs
        self.finished = finished
        self.metrics = metrics
        self.lora_request = lora_request
        self.num_cached_tokens = num_cached_tokens
        # Decoder-only models: vLLM's encoder fields exist and are None.
        self.encoder_prompt: str | None = None
        self.encoder_prompt_token_ids: list[int] | None = None

    def add(self, next_output: RequestOutput, aggregate: bool) -> None:
        """Merges a later output of the same request into this one (for streaming).

        Args:
            next_output: The later output.
            aggregate: Append its text, tokens and logprobs (DELTA outputs) rather than
                replace the matching sequences (CUMULATIVE outputs).
        """
        self.finished |= next_output.finished
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for nxt in next_output.outputs:
            i = by_index.get(nxt.index)
            if i is None:
                self.outputs.append(nxt)
            elif aggregate:
                _extend(self.outputs[i], nxt)
            else:
                self.outputs[i] = nxt

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, "
            f"prompt_logprobs={self.prompt_logprobs}, outputs={self.outputs}, "
            f"finished={self.finished}, metrics={self.metrics}, "
            f"lora_request={self.lora_request}, num_cached_tokens={self.num_cached_tokens})"
        )


def _extend(done: CompletionOutput, new: CompletionOutput) -> None:
    """Appends a DELTA output's new part to the accumulated one."""
    done.text += new.text
    done.token_ids = list(done.token_ids) + list(new.token_ids)
    if new.logprobs:
        done.logprobs = (done.logprobs or []) + list(new.logprobs)
    done.cumulative_logprob = new.cumulative_logprob
    done.finish_reason = new.finish_reason
    done.stop_reason = new.stop_reason
