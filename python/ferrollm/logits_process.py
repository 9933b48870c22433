"""Per-request logits processors' type, at vLLM's path (`vllm.logits_process`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

if TYPE_CHECKING:
    import torch

__all__ = ["LogitsProcessor"]

# `(output_ids, logits_row) -> logits_row`, or `(prompt_ids, output_ids, logits_row) -> logits_row`.
LogitsProcessor = Union[
    Callable[[list[int], "torch.Tensor"], "torch.Tensor"],
    Callable[[list[int], list[int], "torch.Tensor"], "torch.Tensor"],
    Callable[..., Any],
]
