"""Processes the multimodal prompts of one `generate` call before they reach the engine."""

from __future__ import annotations

from typing import Any

from ferrollm.exceptions import InvalidRequestError
from ferrollm.multimodal.inputs import MultiModalInputs

__all__ = ["process_multimodal"]


def process_multimodal(engine, items: list[tuple[str | None, str | list[int]]],
                       fields: list[tuple[dict[str, Any] | None, dict[str, Any] | None]],
                       add_special_tokens: bool) -> list[MultiModalInputs | None]:
    """Per prompt, its processed images (None for a prompt without ``multi_modal_data``). Text
    prompts with images are tokenized here, so their placeholders can be expanded.

    Raises:
        InvalidRequestError: images for a text-only model, or what the processor refuses.
    """
    out: list[MultiModalInputs | None] = []
    for i, ((_, prompt), (mm_data, kwargs)) in enumerate(zip(items, fields)):
        if not mm_data:
            out.append(None)
            continue
        if engine.mm_processor is None:
            raise InvalidRequestError(f"`multi_modal_data` of prompt {i} must be None or absent: "
                                      f"{engine.model_config.architecture} is not a multimodal model")
        if isinstance(prompt, str):
            ids = engine.tokenizers.core.encode(engine.mm_processor.prompt_text(prompt), add_special_tokens)
        else:
            ids = list(prompt)
        out.append(engine.mm_processor.process(ids, mm_data, kwargs))
    return out
