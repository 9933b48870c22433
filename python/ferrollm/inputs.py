"""vLLM's prompt types (`vllm.inputs`): what `LLM.generate`, `encode` and `embed` accept as a
prompt. They are TypedDicts, so a plain dict works the same.

Text-only: a prompt carrying `multi_modal_data` or `mm_processor_kwargs` is refused
(`entrypoints/prompts.py`), never run without them.
"""

from __future__ import annotations

from typing import Any, TypeAlias, TypedDict

from typing_extensions import NotRequired

__all__ = ["PromptType", "SingletonPrompt", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine.

    Attributes:
        prompt: the text.
        multi_modal_data, mm_processor_kwargs: vLLM's multimodal inputs (refused here).
        cache_salt: vLLM's per-request prefix-cache salt (refused here).
    """

    prompt: str
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any] | None]
    cache_salt: NotRequired[str]


class TokensPrompt(TypedDict):
    """A tokenized prompt.

    Attributes:
        prompt_token_ids: the token ids.
        prompt: the text they came from, echoed in `RequestOutput.prompt`.
        token_type_ids: cross-encoder token types (vLLM's; refused here).
        multi_modal_data, mm_processor_kwargs: vLLM's multimodal inputs (refused here).
        cache_salt: vLLM's per-request prefix-cache salt (refused here).
    """

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    token_type_ids: NotRequired[list[int]]
    multi_modal_data: NotRequired[Any]
    mm_processor_kwargs: NotRequired[dict[str, Any] | None]
    cache_salt: NotRequired[str]


SingletonPrompt: TypeAlias = "str | TextPrompt | TokensPrompt"
PromptType: TypeAlias = SingletonPrompt
