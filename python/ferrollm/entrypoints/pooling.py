"""`LLM.encode`, `LLM.embed` and `LLM.score`: vLLM's offline pooling API.

A mixin of `LLM` (vLLM keeps the same methods in a pooling mixin too). Prompts are tokenized
here rather than in the core because truncation must see the tokens: ``truncate_prompt_tokens``
keeps the last ``k`` (text prompts are truncated by the tokenizer from the left, so special
tokens such as BERT's ``[CLS]``/``[SEP]`` stay, as vLLM's left-truncating tokenizer does).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ferrollm.entrypoints.prompts import normalize_prompts
from ferrollm.exceptions import InvalidRequestError, PromptTooLongError
from ferrollm.outputs import (
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from ferrollm.pooling_params import SUPPORTED_POOLING_TASKS, PoolingParams

if TYPE_CHECKING:
    from ferrollm.engine.llm_engine import LLMEngine

__all__ = ["PoolingMixin"]


class PoolingMixin:
    """The pooling methods of `LLM`; they need a model built with ``runner="pooling"``."""

    _request_counter: Any

    def _engine(self) -> LLMEngine:
        raise NotImplementedError

    def encode(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput]:
        """Pools the hidden states of each prompt.

        Args:
            prompts: a string, a `{"prompt": ...}` or `{"prompt_token_ids": [...]}` dict, or a
                list of these.
            pooling_params: one for all prompts, one per prompt, or None for the defaults.
            truncate_prompt_tokens: keep only the last ``k`` tokens of each prompt (-1: the
                model's ``max_model_len``).
            use_tqdm: show a progress bar.
            pooling_task: ``"embed"`` (one vector per prompt; the default, as older vLLM
                chose for embedding models) or ``"token_embed"`` (one vector per token).

        Returns:
            One `PoolingRequestOutput` per prompt, in input order; ``outputs.data`` is a
            float32 CPU tensor.
        """
        engine = self._pooling_engine("encode")
        task = "embed" if pooling_task is None else pooling_task
        if task not in SUPPORTED_POOLING_TASKS:
            raise InvalidRequestError(f"`pooling_task` must be one of {list(SUPPORTED_POOLING_TASKS)}. Given: {task!r}")
        items = normalize_prompts(prompts, engine.vocab_size)
        params = _expand_params(pooling_params, len(items), task, truncate_prompt_tokens, engine)
        token_ids = _tokenize(engine, items, params)
        ids = [str(next(self._request_counter)) for _ in items]
        engine.add_pooling_requests(ids, token_ids, params)
        results = _run(engine, ids, use_tqdm)
        return [PoolingRequestOutput(rid, PoolingOutput(results[rid]), toks, 0, True)
                for rid, toks in zip(ids, token_ids)]

    def embed(
        self,
        prompts: Any,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding vector per prompt.

        Args:
            prompts: as in `encode`.
            pooling_params: ``dimensions``, ``normalize``, ``truncate_prompt_tokens``; one for
                all prompts, one per prompt, or None for the model's defaults.
            truncate_prompt_tokens: as in `encode`.
            use_tqdm: show a progress bar.

        Returns:
            One `EmbeddingRequestOutput` per prompt (``outputs.embedding`` is a list of floats).
        """
        self._pooling_engine("embed")
        outputs = self.encode(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                              use_tqdm=use_tqdm, pooling_task="embed")
        return [EmbeddingRequestOutput.from_base(o) for o in outputs]

    def score(
        self,
        data_1: Any,
        data_2: Any,
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """Cosine similarity of the embeddings of each pair ``(data_1[i], data_2[i])``.

        The inputs pair 1 -> 1, 1 -> N (the single ``data_1`` is paired with every
        ``data_2``) or N -> N.

        Args:
            data_1: a prompt or a list of prompts.
            data_2: a prompt or a list of prompts.
            truncate_prompt_tokens: as in `encode`.
            use_tqdm: show a progress bar.
            pooling_params: applied to every prompt's embedding.

        Returns:
            One `ScoringRequestOutput` per pair (``outputs.score`` is a float).
        """
        self._pooling_engine("score")
        first, second = _as_list(data_1), _as_list(data_2)
        if not first or not second:
            raise InvalidRequestError(f"`data_1` and `data_2` must each hold at least one prompt. "
                                      f"Given: {len(first)} and {len(second)}")
        if len(first) > 1 and len(first) != len(second):
            raise InvalidRequestError(f"`data_1` and `data_2` must pair 1:1, 1:N or N:N. "
                                      f"Given: {len(first)} and {len(second)} prompts")
        embedded = self.encode(first + second, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                               use_tqdm=use_tqdm, pooling_task="embed")
        left, right = embedded[: len(first)], embedded[len(first):]
        if len(left) == 1:
            left = left * len(right)
        pad = getattr(self._engine().tokenizers.hf, "pad_token_id", None)
        sep = [] if pad is None else [pad]
        return [
            ScoringRequestOutput.from_base(PoolingRequestOutput(
                f"{a.request_id}_{b.request_id}",
                PoolingOutput(F.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)),
                a.prompt_token_ids + sep + b.prompt_token_ids, 0, True))
            for a, b in zip(left, right)
        ]

    def _pooling_engine(self, method: str) -> LLMEngine:
        engine = self._engine()
        mc = engine.model_config
        if not mc.is_pooling:
            raise InvalidRequestError(
                f"LLM.{method}() needs a pooling model, but this LLM runs {mc.architecture} as a "
                f"generative model. Build it with LLM(model=..., runner='pooling') (or convert='embed') "
                f"to use it as an embedding model.")
        return engine


def _as_list(data: Any) -> list[Any]:
    return [data] if isinstance(data, (str, dict)) else list(data)


def _expand_params(pooling_params, n: int, task: str, truncate: int | None, engine: LLMEngine) -> list[PoolingParams]:
    """One verified copy per prompt (verification fills in defaults, so the caller's objects
    stay untouched); a single object is verified once and shared."""
    if truncate is not None:
        PoolingParams(truncate_prompt_tokens=truncate)  # the argument's bounds, checked as a field's
    if pooling_params is None or not isinstance(pooling_params, Sequence):
        shared = _verified(pooling_params or PoolingParams(), task, truncate, engine)
        return [shared] * n
    params = list(pooling_params)
    if len(params) != n:
        raise InvalidRequestError(f"`pooling_params` must be one per prompt ({n}) or a single one. Given: {len(params)}")
    return [_verified(p, task, truncate, engine) for p in params]


def _verified(p: Any, task: str, truncate: int | None, engine: LLMEngine) -> PoolingParams:
    if not isinstance(p, PoolingParams):
        raise InvalidRequestError(f"`pooling_params` must be PoolingParams. Given: {type(p).__name__}")
    p = p.clone()
    if truncate is not None:
        if p.truncate_prompt_tokens is not None and p.truncate_prompt_tokens != truncate:
            raise InvalidRequestError(
                f"`truncate_prompt_tokens` must agree with pooling_params.truncate_prompt_tokens "
                f"({p.truncate_prompt_tokens}) when both are given. Given: {truncate}")
        p.truncate_prompt_tokens = truncate
    max_len = engine.model_config.max_model_len
    if p.truncate_prompt_tokens == -1:
        p.truncate_prompt_tokens = max_len
    elif p.truncate_prompt_tokens is not None and p.truncate_prompt_tokens > max_len:
        raise InvalidRequestError(f"`truncate_prompt_tokens` must be <= max_model_len ({max_len}) or -1. "
                                  f"Given: {p.truncate_prompt_tokens}")
    assert engine.model_config.pooler is not None
    p.verify(task, engine.model_config.pooler)
    return p


def _tokenize(engine: LLMEngine, items: list[tuple[str | None, str | list[int]]],
              params: list[PoolingParams]) -> list[list[int]]:
    """Token ids of every prompt, truncated per its params, checked against `max_model_len`."""
    lower = engine.model_config.do_lower_case
    out: list[list[int] | None] = [None] * len(items)
    texts: dict[int | None, list[tuple[int, str]]] = {}  # truncation -> (index, text)
    for i, ((_, prompt), p) in enumerate(zip(items, params)):
        k = p.truncate_prompt_tokens
        if isinstance(prompt, str):
            texts.setdefault(k, []).append((i, prompt.lower() if lower else prompt))
        else:
            out[i] = list(prompt) if k is None else list(prompt)[-k:]
    for k, group in texts.items():
        for (i, _), ids in zip(group, _encode_texts(engine, [t for _, t in group], k)):
            out[i] = ids
    token_ids = [ids for ids in out if ids is not None]
    max_len = engine.model_config.max_model_len
    for i, ids in enumerate(token_ids):
        if not ids:
            raise InvalidRequestError(f"prompt {i} must have at least one token (The decoder prompt cannot be "
                                      "empty). Given: an empty prompt")
        if len(ids) > max_len:
            raise PromptTooLongError(
                f"prompt {i} must have at most max_model_len ({max_len}) tokens, or pass "
                f"truncate_prompt_tokens (e.g. -1) to keep its last {max_len}. Given: {len(ids)} tokens (the "
                f"prompt (length {len(ids)}) is longer than the maximum model length of {max_len})")
    return token_ids


def _encode_texts(engine: LLMEngine, texts: list[str], truncate: int | None) -> list[list[int]]:
    if truncate is None:
        return engine.tokenizers.encode_batch(texts)
    hf = engine.tokenizers.hf
    side = hf.truncation_side
    hf.truncation_side = "left"
    try:
        return hf(texts, truncation=True, max_length=truncate)["input_ids"]
    finally:
        hf.truncation_side = side


def _run(engine: LLMEngine, request_ids: list[str], use_tqdm: bool) -> dict[str, torch.Tensor]:
    """Steps the engine until every request is pooled; returns the results by request id."""
    from ferrollm.entrypoints.llm import _progress

    runner = engine.pooling_runner
    results: dict[str, torch.Tensor] = {}
    bar = _progress(len(request_ids), use_tqdm)
    start, num_in = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            pooled = runner.release(out.request_id)
            if pooled is not None:
                results[out.request_id] = pooled
            if bar is not None:
                num_in += len(out.prompt_token_ids)
                bar.set_postfix_str(f"est. speed input: {num_in / max(time.perf_counter() - start, 1e-9):.2f} toks/s")
                bar.update(1)
    if bar is not None:
        bar.close()
    return results
