"""The processed form of one request's multimodal data, as the runner consumes it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MultiModalItem:
    """One processed image.

    Attributes:
        modality: ``"image"``.
        identifier: content hash of the item and the processor options that shaped it; it keys
            the input cache and enters the prefix cache's block hashes.
        offset: the prompt position of its first placeholder token.
        length: its placeholder tokens (the encoder's output rows).
        pixel_values: the processor's flattened patches ``[num_patches, patch_dim]``.
        grid: the (t, h, w) patch grid.
    """

    modality: str
    identifier: str
    offset: int
    length: int
    pixel_values: torch.Tensor
    grid: tuple[int, int, int]


@dataclass
class MultiModalInputs:
    """A request's prompt with placeholders expanded, and its items in prompt order."""

    prompt_token_ids: list[int]
    items: list[MultiModalItem] = field(default_factory=list)

    def core_features(self) -> list[tuple[str, int, int]]:
        """(identifier, offset, length) per item, as `EngineCore.add_requests` takes them."""
        return [(it.identifier, it.offset, it.length) for it in self.items]
