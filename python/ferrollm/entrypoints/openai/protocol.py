"""The OpenAI request bodies the server reads (pydantic models) and their translation into
`SamplingParams`. Field names and defaults follow OpenAI's API as vLLM serves it; fields vLLM
adds for its own sampling options (`top_k`, `min_p`, `repetition_penalty`, `ignore_eos`, ...)
are accepted too. Unknown fields are ignored, as OpenAI's clients send newer ones freely.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ferrollm.sampling_params import RequestOutputKind, SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _Sampling(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any],
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request as `SamplingParams`; unset fields take the model's defaults, then vLLM's.
        Streaming asks the engine for deltas."""
        fields = dict(defaults)
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                fields[name] = getattr(self, name)
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        return SamplingParams(
            **fields, n=self.n, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            skip_special_tokens=self.skip_special_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
        )


class CompletionRequest(_Sampling):
    """`POST /v1/completions`."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Sampling):
    """`POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None


class EmbeddingRequest(BaseModel):
    """`POST /v1/embeddings` (a pooling model)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    user: str | None = None


class TokenizeRequest(BaseModel):
    """`POST /tokenize`: a prompt, or messages rendered with the chat template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


ErrorType = Literal["BadRequestError", "AuthenticationError", "NotFoundError", "InternalServerError"]


def error_body(message: str, err_type: ErrorType, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}
