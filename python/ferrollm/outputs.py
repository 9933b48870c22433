"""What `LLM` returns, with vLLM's class and field names so scripts written against vLLM read them
unchanged: `RequestOutput`, `CompletionOutput` and `Logprob` from `generate`; `PoolingRequestOutput`
(`encode`), `EmbeddingRequestOutput` (`embed`) and `ScoringRequestOutput` (`score`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

# The logprob types live at vLLM's path (`ferrollm.logprobs`); kept importable from here.
from ferrollm.logprobs import Logprob, PromptLogprobs, SampleLogprobs

if TYPE_CHECKING:  # torch stays out of `import ferrollm`
    import torch

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Logprob",
    "PoolingOutput",
    "PoolingRequestOutput",
    "PromptLogprobs",
    "RequestOutput",
    "SampleLogprobs",
    "ScoringOutput",
    "ScoringRequestOutput",
]


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
        if done.logprobs is None:
            done.logprobs = new.logprobs[:]  # a copy: the delta output stays as it was
        else:
            done.logprobs.extend(new.logprobs)  # a list or a FlatLogprobs, kept as it is
    done.cumulative_logprob = new.cumulative_logprob
    done.finish_reason = new.finish_reason
    done.stop_reason = new.stop_reason


@dataclass
class PoolingOutput:
    """The pooled result of one request.

    Args:
        data: float32 CPU tensor: ``[hidden]`` for ``embed``, ``[num_tokens, hidden]`` for
            ``token_embed``, a scalar for a score.
    """

    data: torch.Tensor

    def __repr__(self) -> str:
        return f"PoolingOutput(data={self.data!r})"

    def __eq__(self, other: object) -> bool:
        import torch

        return isinstance(other, PoolingOutput) and bool(torch.equal(self.data, other.data))


_O = TypeVar("_O")


class PoolingRequestOutput(Generic[_O]):
    """Everything returned for one pooling request.

    Args:
        request_id: The request's id.
        outputs: The pooled result (`PoolingOutput`, or `EmbeddingOutput`/`ScoringOutput` in
            the subclasses).
        prompt_token_ids: The prompt's token ids, after any truncation.
        num_cached_tokens: Prompt tokens served from the prefix cache (always 0 here).
        finished: Whether the request has finished (always True offline).
    """

    def __init__(self, request_id: str, outputs: _O, prompt_token_ids: list[int],
                 num_cached_tokens: int = 0, finished: bool = True) -> None:
        self.request_id = request_id
        self.outputs = outputs
        self.prompt_token_ids = prompt_token_ids
        self.num_cached_tokens = num_cached_tokens
        self.finished = finished

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(request_id={self.request_id!r}, outputs={self.outputs!r}, "
                f"prompt_token_ids={self.prompt_token_ids}, num_cached_tokens={self.num_cached_tokens}, "
                f"finished={self.finished})")


@dataclass
class EmbeddingOutput:
    """One request's embedding.

    Args:
        embedding: The embedding vector.
    """

    embedding: list[float]

    @staticmethod
    def from_base(output: PoolingOutput) -> EmbeddingOutput:
        """The embedding of a 1-D `PoolingOutput`.

        Raises:
            ValueError: if the pooled data is not one vector.
        """
        if output.data.ndim != 1:
            raise ValueError(f"an embedding must be a 1-D vector; the pooled data has shape {tuple(output.data.shape)}")
        return EmbeddingOutput(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        """The embedding's length."""
        return len(self.embedding)

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    """What `LLM.embed` returns for one prompt (`outputs.embedding` is a list of floats)."""

    @staticmethod
    def from_base(output: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return EmbeddingRequestOutput(output.request_id, EmbeddingOutput.from_base(output.outputs),
                                      output.prompt_token_ids, output.num_cached_tokens, output.finished)


@dataclass
class ScoringOutput:
    """One pair's score.

    Args:
        score: The similarity score.
    """

    score: float

    @staticmethod
    def from_base(output: PoolingOutput) -> ScoringOutput:
        """The score of a scalar (or one-element) `PoolingOutput`.

        Raises:
            ValueError: if the pooled data is not a single number.
        """
        data = output.data.squeeze()
        if data.ndim != 0:
            raise ValueError(f"a score must be a scalar; the pooled data has shape {tuple(output.data.shape)}")
        return ScoringOutput(float(data.item()))

    def __repr__(self) -> str:
        return f"ScoringOutput(score={self.score})"


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    """What `LLM.score` returns for one pair (`outputs.score` is a float)."""

    @staticmethod
    def from_base(output: PoolingRequestOutput) -> ScoringRequestOutput:
        return ScoringRequestOutput(output.request_id, ScoringOutput.from_base(output.outputs),
                                    output.prompt_token_ids, output.num_cached_tokens, output.finished)
