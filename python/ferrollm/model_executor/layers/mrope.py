"""Multimodal rotary embedding (M-RoPE, Qwen2-VL): every token has three positions (time, row,
column) and each band of rotary frequencies follows one of them (``mrope_section`` frequencies
each).

Text tokens carry three equal positions, so a text-only sequence rotates exactly as 1-D RoPE.
An image's placeholder tokens carry (start, start + row, start + column) over its merged patch
grid, and the text after it resumes at ``start + max(rows, columns)``: a request's positions
therefore differ from its token indices by a per-request delta after its last image.

Where positions are computed: in the model runner, once per request, from the prompt's token
ids and its images' grids (:func:`mrope_positions`); the Rust core keeps emitting 1-D token
indices and the runner maps them (prompt rows through the table, later rows by adding the
delta). The core needs no notion of images for this, and the table costs 24 bytes a prompt token.
"""

from __future__ import annotations

import numpy as np
import torch

from ferrollm.model_executor.layers.rotary import RotaryEmbedding

__all__ = ["MRotaryEmbedding", "mrope_positions"]


class MRotaryEmbedding(RotaryEmbedding):
    """NeoX-style rotary embedding whose frequency bands follow the (t, h, w) positions.

    Args:
        mrope_section: frequencies per band (sums to ``rotary_dim // 2``).
        The other arguments are `RotaryEmbedding`'s.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float,
                 mrope_section: list[int], dtype: torch.dtype | None = None, scaling=None):
        super().__init__(head_size, rotary_dim, max_position, base, True, dtype, scaling)
        if sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"`mrope_section` must sum to rotary_dim // 2 ({rotary_dim // 2}). Given: {mrope_section}")
        # Band of each frequency: 0 (time), 1 (row) or 2 (column), cycling as the sections go.
        band = torch.cat([torch.full((n,), i % 3) for i, n in enumerate(mrope_section)])
        self.register_buffer("band", band, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """``positions``: int64 ``[3, num_tokens]`` (or ``[num_tokens]`` for text only)."""
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        half = self.rotary_dim // 2
        table = self.cos_sin_cache[positions]  # [3, n, rotary_dim]
        picked = table.gather(0, self.band.repeat(2).expand(1, positions.shape[1], -1)).squeeze(0)
        cos, sin = picked[:, :half], picked[:, half:]
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)


def mrope_positions(token_ids: np.ndarray, image_token_id: int, grids: list[tuple[int, int, int]],
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """The (t, h, w) positions of a prompt whose images' placeholders are already expanded.

    Args:
        token_ids: the prompt.
        image_token_id: the placeholder id; each image's run of ``t * h * w / merge**2``
            placeholders is taken in order.
        grids: each image's patch grid (t, h, w), in prompt order.
        spatial_merge_size: patches merged per side into one token.

    Returns:
        int64 ``[3, len(token_ids)]`` positions and the delta later tokens add to their index.
    """
    n = len(token_ids)
    out = np.empty((3, n), dtype=np.int64)
    is_image = np.asarray(token_ids) == image_token_id
    cursor, next_pos = 0, 0
    for t, h, w in grids:
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        length = t * gh * gw
        start = cursor + int(np.argmax(is_image[cursor:]))
        text = start - cursor
        out[:, cursor:start] = np.arange(next_pos, next_pos + text)
        next_pos += text
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[:, start : start + length] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + next_pos
        next_pos += max(gh, gw)
        cursor = start + length
    out[:, cursor:] = np.arange(next_pos, next_pos + n - cursor)
    return out, (int(out.max()) + 1 - n) if n else 0
