"""The vision encoder's worst step, for the GPU start-up profile: as many of the largest images
the `LLM`'s processor options allow as the step's encoder budget admits, as blank patches.

vLLM profiles the encoder the same way, so the KV cache leaves room for its activations; the
log line of the profile names what was run.
"""

from __future__ import annotations

import math

import torch

__all__ = ["encoder_worst_case", "run_encoder_worst_case"]


def encoder_worst_case(encoder_budget: int, tokens_per_item: int, merge: int) -> list[tuple[int, int, int]]:
    """The patch grids of the worst step: ``encoder_budget // tokens_per_item`` square-ish
    images of at most ``tokens_per_item`` placeholder tokens each (none when either is 0)."""
    if encoder_budget <= 0 or tokens_per_item <= 0:
        return []
    side = max(1, math.isqrt(tokens_per_item))
    rows, cols = side, max(1, tokens_per_item // side)
    return [(1, rows * merge, cols * merge)] * max(1, encoder_budget // tokens_per_item)


def run_encoder_worst_case(model, encoder_budget: int, tokens_per_item: int, device: torch.device) -> str:
    """Encodes the worst step with blank pixels; returns what ran, for the log ('' when the
    model has no vision tower)."""
    if hasattr(model, "dummy_images"):  # fixed-size images (Gemma 3)
        if encoder_budget <= 0 or tokens_per_item <= 0 or getattr(model, "vision_tower", None) is None:
            return ""
        pixels, grids = model.dummy_images(max(1, encoder_budget // tokens_per_item), device)
        model.encode_images(pixels, grids)
        return f"{len(grids)} image(s) of {pixels.shape[-2]}x{pixels.shape[-1]} pixels"
    visual = getattr(model, "visual", None)
    if visual is None:
        return ""
    grids = encoder_worst_case(encoder_budget, tokens_per_item, visual.merge)
    if not grids:
        return ""
    patch_dim = visual.in_channels * visual.temporal_patch_size * visual.patch_size**2
    num_patches = sum(t * h * w for t, h, w in grids)
    pixels = torch.zeros(num_patches, patch_dim, device=device)
    model.encode_images(pixels, grids)
    _, h, w = grids[0]
    return f"{len(grids)} image(s) of {h}x{w} patches"
