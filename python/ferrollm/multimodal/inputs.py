"""The processed form of one request's multimodal data, as the runner consumes it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MultiModalItem:
    """One processed image or video.

    Attributes:
        modality: ``"image"`` or ``"video"``.
        identifier: content hash of the item and the processor options that shaped it; it keys
            the input cache and enters the prefix cache's block hashes.
        offset: the prompt position of its first placeholder token.
        length: its placeholder tokens (the encoder's output rows).
        pixel_values: the processor's flattened patches ``[num_patches, patch_dim]`` (a video's
            ``pixel_values_videos``: the same layout, so images and videos share encoder calls).
        grid: the (t, h, w) patch grid.
        second_per_grid_t: a video's seconds per temporal patch (transformers'
            ``second_per_grid_ts``), which scales Qwen2.5-VL's temporal M-RoPE positions; None
            for images.
    """

    modality: str
    identifier: str
    offset: int
    length: int
    pixel_values: torch.Tensor
    grid: tuple[int, int, int]
    second_per_grid_t: float | None = None


@dataclass
class MultiModalInputs:
    """A request's prompt with placeholders expanded, and its items in prompt order."""

    prompt_token_ids: list[int]
    items: list[MultiModalItem] = field(default_factory=list)

    def core_features(self) -> list[tuple[str, int, int]]:
        """(identifier, offset, length) per item, as `EngineCore.add_requests` takes them."""
        return [(it.identifier, it.offset, it.length) for it in self.items]
