"""`/v1/completions` and `/v1/chat/completions`: translate an OpenAI request into prompts and
`SamplingParams`, run them on `AsyncLLM`, and translate the `RequestOutput`s back, whole or as
server-sent events. No engine state lives here: a request's generators are its only handle, and
closing them (the client went away) aborts it.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from ferrollm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ErrorType,
    _Sampling,
    error_body,
)
from ferrollm.exceptions import InvalidRequestError
from ferrollm.multimodal.chat import extract_images, processor_chat_template
from ferrollm.multimodal.content_format import join_parts, resolve_content_format
from ferrollm.outputs import CompletionOutput, RequestOutput
from ferrollm.pooling_params import PoolingParams
from ferrollm.v1.engine.async_llm import AsyncLLM


class OpenAIServing:
    """The two generation endpoints over one engine.

    Args:
        engine: The running `AsyncLLM`.
        model_name: The name responses carry (the first `--served-model-name`).
        chat_template: A template that replaces the tokenizer's, or None.
        content_format: ``--chat-template-content-format`` ("auto", "string" or "openai").
    """

    def __init__(self, engine: AsyncLLM, model_name: str, chat_template: str | None, content_format: str = "auto"):
        self.engine = engine
        self.model_name = model_name
        self.chat_template = chat_template
        self.content_format = content_format
        self.tokenizer = engine.engine.tokenizers.hf
        self.max_model_len = engine.model_config.max_model_len
        # Multimodal checkpoints may keep their template beside the processor instead.
        self.processor_chat_template = processor_chat_template(engine.model_config.source.folder)

    # -- completions --------------------------------------------------------------------------

    async def completion(self, req: CompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        """A response body, or the SSE lines of a streamed one."""
        for name, bad in (("echo", req.echo), ("suffix", req.suffix is not None),
                          ("best_of", req.best_of not in (None, req.n))):
            if bad:
                raise InvalidRequestError(f"`{name}` is not supported by ferrollm serve yet. Given: {getattr(req, name)!r}")
        prompts = _completion_prompts(req.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        gens = [self.engine.generate(p, self._params(req, req.max_tokens, req.logprobs, p), f"{rid}-{i}")
                for i, p in enumerate(prompts)]
        head = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return await _sse(self._completion_chunks(req, gens, head))
        finals = await asyncio.gather(*[_last(g) for g in gens])
        choices = [_completion_choice(i * req.n + c.index, c, req.logprobs) for i, out in enumerate(finals)
                   for c in out.outputs]
        return {**head, "object": "text_completion", "choices": choices, "usage": _usage(finals)}

    async def _completion_chunks(self, req: CompletionRequest, gens: list, head: dict) -> AsyncGenerator[dict, None]:
        usage = _StreamUsage()
        async for i, out in _merge(gens):
            usage.add(i, out)
            for c in out.outputs:
                yield {**head, "object": "text_completion",
                       "choices": [_completion_choice(i * req.n + c.index, c, req.logprobs)]}
        if req.stream_options is not None and req.stream_options.include_usage:
            yield {**head, "object": "text_completion", "choices": [], "usage": usage.body()}

    # -- embeddings ---------------------------------------------------------------------------

    async def embeddings(self, req: EmbeddingRequest) -> dict[str, Any]:
        """One vector per input, as floats or base64 of little-endian float32 (what the openai
        client asks for by default)."""
        import base64

        params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize)
        rid = f"embd-{uuid.uuid4().hex}"
        gens = [self.engine.encode(p, params, f"{rid}-{i}", truncate_prompt_tokens=req.truncate_prompt_tokens)
                for i, p in enumerate(_completion_prompts(req.input))]
        outs = await asyncio.gather(*[_last(g) for g in gens])
        data = []
        for i, out in enumerate(outs):
            vec = out.outputs.data.float().numpy()
            emb: Any = (base64.b64encode(vec.astype("<f4").tobytes()).decode() if req.encoding_format == "base64"
                        else vec.tolist())
            data.append({"object": "embedding", "embedding": emb, "index": i})
        num = sum(len(o.prompt_token_ids) for o in outs)
        return {"id": rid, "object": "list", "created": int(time.time()), "model": self.model_name, "data": data,
                "usage": {"prompt_tokens": num, "total_tokens": num}}

    # -- chat ---------------------------------------------------------------------------------

    async def chat(self, req: ChatCompletionRequest) -> dict[str, Any] | AsyncIterator[str]:
        if req.tools or (req.response_format or {}).get("type", "text") != "text":
            raise InvalidRequestError("`tools` and `response_format` are not supported by ferrollm serve yet")
        prompt = self.render_chat(req.messages, req.add_generation_prompt and not req.continue_final_message,
                                  req.chat_template, req.continue_final_message, req.chat_template_kwargs)
        top = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        # The rendered template holds the special tokens (an image prompt is tokenized later).
        gen = self.engine.generate(prompt, self._params(req, max_tokens, top, prompt), rid,
                                   tokenization_kwargs={"add_special_tokens": False})
        head = {"id": rid, "created": int(time.time()), "model": self.model_name}
        if req.stream:
            return await _sse(self._chat_chunks(req, gen, head))
        final = await _last(gen)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": _chat_logprobs(c, req.top_logprobs or 0) if req.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in final.outputs]
        return {**head, "object": "chat.completion", "choices": choices, "usage": _usage([final])}

    async def _chat_chunks(self, req: ChatCompletionRequest, gen, head: dict) -> AsyncGenerator[dict, None]:
        chunk = {**head, "object": "chat.completion.chunk"}
        started: set[int] = set()
        usage = _StreamUsage()
        async for out in gen:
            usage.add(0, out)
            for c in out.outputs:
                delta: dict[str, Any] = {"content": c.text}
                if c.index not in started:  # the first chunk of a choice names its role
                    started.add(c.index)
                    delta["role"] = "assistant"
                yield {**chunk, "choices": [{"index": c.index, "delta": delta,
                                             "logprobs": _chat_logprobs(c, req.top_logprobs or 0) if req.logprobs else None,
                                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
        if req.stream_options is not None and req.stream_options.include_usage:
            yield {**chunk, "choices": [], "usage": usage.body()}

    def render_chat(self, messages: list, add_generation_prompt: bool, template: str | None = None,
                    continue_final_message: bool = False, kwargs: dict | None = None) -> dict[str, Any]:
        """The conversation through the chat template: a tokens prompt (the template holds the
        special tokens, so none are added), or with image parts (``image_url``: a ``data:`` URL
        or a local path) the text and its ``multi_modal_data``, as `LLM.chat` makes them."""
        conv = [{"role": m.role, "content": _content(m.content)} for m in messages]
        conv, images = extract_images(conv)
        template = template or self.chat_template or self.processor_chat_template
        if not images:  # text parts join into one string, which any template takes
            conv = [{**m, "content": _text_content(m["content"], i)} for i, m in enumerate(conv)]
        elif resolve_content_format(self.content_format, template or self.tokenizer.chat_template) == "string":
            mm_processor = self.engine.engine.mm_processor
            conv = join_parts(conv, mm_processor.placeholders if mm_processor is not None else {})
        if template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("`chat_template` must be given: the model's tokenizer has none "
                                      "(start the server with --chat-template)")
        try:
            text = self.tokenizer.apply_chat_template(
                conv, tokenize=False, chat_template=template, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(kwargs or {}))
        except Exception as e:  # jinja errors name what the template wanted
            raise InvalidRequestError(f"the chat template failed on `messages`: {e}") from e
        if images:
            return {"prompt": text, "multi_modal_data": {"image": images}}
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return {"prompt": text, "prompt_token_ids": ids}

    def _params(self, req: _Sampling, max_tokens: int | None, logprobs: int | None, prompt: Any):
        if max_tokens is None:  # vLLM's default: whatever room the context has left
            max_tokens = max(1, self.max_model_len - _prompt_len(prompt, self.tokenizer))
        return req.sampling_params(max_tokens, logprobs, self.engine.engine.default_sampling_fields)


def _completion_prompts(prompt: Any) -> list[Any]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("`prompt` must not be empty")
    if all(isinstance(t, int) for t in prompt):
        return [{"prompt_token_ids": prompt}]
    return [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompt]


def _prompt_len(prompt: Any, tokenizer: Any) -> int:
    """Tokens of a prompt before any image placeholders are expanded (the core caps the output
    at `max_model_len` in any case)."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return len(prompt["prompt_token_ids"])
        prompt = prompt["prompt"]
    return len(tokenizer(prompt)["input_ids"])


def _content(content: Any) -> Any:
    """A message's content as plain data (parts as dicts)."""
    if content is None or isinstance(content, str):
        return content or ""
    return [p if isinstance(p, dict) else p.model_dump() for p in content]


def _text_content(content: Any, index: int) -> str:
    """A text-only message's text: its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    parts = []
    for part in content:
        if part.get("type") != "text":
            raise InvalidRequestError(f"`messages[{index}].content` parts must be of type 'text' or 'image_url'. "
                                      f"Given: {part.get('type')!r}")
        parts.append(part.get("text", ""))
    return "\n".join(parts)


async def _last(gen) -> Any:
    out = None
    async for out in gen:
        pass
    assert out is not None
    return out


async def _merge(gens: list) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several generators as they come, tagged with the generator's index. Closing
    this closes them all (so every request is aborted)."""
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(i: int, gen) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
        except BaseException as e:
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.create_task(drain(i, g)) for i, g in enumerate(gens)]
    try:
        for _ in range(len(gens)):
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for t in tasks:
            t.cancel()
        for g in gens:
            await g.aclose()


async def _sse(chunks: AsyncGenerator[dict, None]) -> AsyncIterator[str]:
    """Waits for the first chunk (so a bad request is still a plain 400), then streams
    `data: {...}` events and `data: [DONE]`; an error mid-stream becomes an error event."""
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:
        first = None

    async def events() -> AsyncIterator[str]:
        try:
            if first is not None:
                yield f"data: {json.dumps(first)}\n\n"
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk)}\n\n"
        except Exception as e:
            bad = isinstance(e, (ValueError, NotImplementedError))
            kind: ErrorType = "BadRequestError" if bad else "InternalServerError"
            code = 400 if bad else 500
            yield f"data: {json.dumps(error_body(str(e), kind, code))}\n\n"
        finally:
            await chunks.aclose()  # a disconnected client lands here: aborts its requests
        yield "data: [DONE]\n\n"

    return events()


def _usage(finals: list[RequestOutput]) -> dict[str, int]:
    prompt = sum(len(o.prompt_token_ids or []) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class _StreamUsage:
    """Token counts of a streamed response, added up from its deltas."""

    def __init__(self) -> None:
        self.prompt: dict[int, int] = {}
        self.completion = 0

    def add(self, i: int, out: RequestOutput) -> None:
        if out.prompt_token_ids:
            self.prompt[i] = len(out.prompt_token_ids)
        self.completion += sum(len(c.token_ids) for c in out.outputs)

    def body(self) -> dict[str, int]:
        prompt = sum(self.prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion, "total_tokens": prompt + self.completion}


def _completion_choice(index: int, c: CompletionOutput, logprobs: int | None) -> dict[str, Any]:
    return {"index": index, "text": c.text, "logprobs": _completion_logprobs(c) if logprobs is not None else None,
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def _completion_logprobs(c: CompletionOutput) -> dict[str, Any]:
    """OpenAI's legacy layout: parallel lists of tokens, their logprobs, top alternatives, offsets."""
    tokens, token_lps, tops, offsets, offset = [], [], [], [], 0
    for tok, pos in zip(c.token_ids, c.logprobs or []):
        chosen = pos[tok]
        text = chosen.decoded_token or ""
        tokens.append(text)
        token_lps.append(chosen.logprob)
        tops.append({(lp.decoded_token or ""): lp.logprob for lp in pos.values()})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def _chat_logprobs(c: CompletionOutput, k: int) -> dict[str, Any]:
    """Per token, its logprob and the `k` most likely tokens at its position."""
    def entry(lp) -> dict[str, Any]:
        text = lp.decoded_token or ""
        return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode())}

    content = []
    for tok, pos in zip(c.token_ids, c.logprobs or []):
        top = sorted(pos.values(), key=lambda lp: lp.rank if lp.rank is not None else 1 << 30)[:k]
        content.append({**entry(pos[tok]), "top_logprobs": [entry(lp) for lp in top]})
    return {"content": content}
