"""Normalizes what `LLM.generate` accepts into (prompt text or None, prompt for the core)."""

from __future__ import annotations

from typing import Any

from ferrollm.exceptions import InvalidRequestError


def normalize_prompts(prompts: Any, vocab_size: int) -> list[tuple[str | None, str | list[int]]]:
    """Accepts a string, a `{"prompt": str}` or `{"prompt_token_ids": [...]}` dict, or a list of
    these; returns one (text, core prompt) pair per prompt.

    Raises:
        InvalidRequestError: an unknown prompt form, or a token id outside the vocabulary.
    """
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, dict):
            _refuse_unsupported_fields(p, i)
        if isinstance(p, str):
            out.append((p, p))
        elif isinstance(p, dict) and "prompt_token_ids" in p:
            ids = [int(t) for t in p["prompt_token_ids"]]
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise InvalidRequestError(f"Token id {bad[0]} is out of vocabulary: `prompt_token_ids` of prompt {i} "
                                          f"must be in [0, {vocab_size}). Given: {bad[0]}")
            out.append((p.get("prompt"), ids))
        elif isinstance(p, dict) and isinstance(p.get("prompt"), str):
            out.append((p["prompt"], p["prompt"]))
        else:
            raise InvalidRequestError(
                f"`prompts` must be strings or dicts with 'prompt' or 'prompt_token_ids'. Given: {type(p).__name__} at index {i}"
            )
    return out


# TextPrompt/TokensPrompt fields vLLM reads that ferrollm does not implement: refused when set,
# so no input is silently dropped.
_UNSUPPORTED = {
    "multi_modal_uuids": "caller-given multimodal item ids are not supported (items are hashed by content)",
    "cache_salt": "per-request prefix-cache salts are not supported yet",
    "token_type_ids": "token type ids (cross-encoders) are not supported",
    "prompt_embeds": "prompt embeddings as input are not supported",
}


def multimodal_fields(prompts: Any) -> list[tuple[dict[str, Any] | None, dict[str, Any] | None]]:
    """Per prompt (in `normalize_prompts` order), its ``multi_modal_data`` and
    ``mm_processor_kwargs`` (None where absent)."""
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    return [(p.get("multi_modal_data"), p.get("mm_processor_kwargs")) if isinstance(p, dict) else (None, None)
            for p in prompts]


def _refuse_unsupported_fields(prompt: dict, index: int) -> None:
    for key, why in _UNSUPPORTED.items():
        if prompt.get(key) is not None:
            raise InvalidRequestError(f"`{key}` of prompt {index} must be None or absent: {why}. "
                                      f"Given: {type(prompt[key]).__name__}")
