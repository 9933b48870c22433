"""Multimodal rotary embedding (M-RoPE, Qwen2-VL): every token has three positions (time, row,
column) and each band of rotary frequencies follows one of them (``mrope_section`` frequencies
each).

Text tokens carry three equal positions, so a text-only sequence rotates exactly as 1-D RoPE.
An image's placeholder tokens carry (start, start + row, start + column) over its merged patch
grid; a video's carry (start + time, start + row, start + column), its time the frame group's
index (Qwen2-VL) or that index scaled to seconds times ``tokens_per_second`` (Qwen2.5-VL). The
text after an item resumes at ``start + max(rows, columns)``: a request's positions
therefore differ from its token indices by a per-request delta after its last item (the
largest position + 1 - the prompt's length).

Where positions are computed: in the model runner, once per request, from its items' offsets
and grids (:func:`mrope_positions`); the Rust core keeps emitting 1-D token indices and the
runner maps them (prompt rows through the table, later rows by adding the delta). The core
needs no notion of images for this, and the table costs 24 bytes a prompt token.
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


def mrope_positions(num_tokens: int, spans: list[tuple[int, tuple[int, int, int], float]],
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """The (t, h, w) positions of a prompt whose items' placeholders are already expanded.

    Args:
        num_tokens: the prompt's length.
        spans: per item, in prompt order: the offset of its first placeholder, its patch grid
            (t, h, w) (``t * h * w / merge**2`` placeholders from the offset) and its time
            interval: the temporal position of frame group ``i`` is ``int(i * interval)`` (1 for
            images and Qwen2-VL's videos; Qwen2.5-VL scales a video's by its seconds per
            group times ``tokens_per_second``).
        spatial_merge_size: patches merged per side into one token.

    Returns:
        int64 ``[3, num_tokens]`` positions and the delta later tokens add to their index.
    """
    out = np.empty((3, num_tokens), dtype=np.int64)
    cursor, next_pos = 0, 0
    for start, (t, h, w), interval in spans:
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        length = t * gh * gw
        text = start - cursor
        out[:, cursor:start] = np.arange(next_pos, next_pos + text)
        next_pos += text
        # In float32 and truncated after the multiply, as transformers computes it (the
        # processor's `second_per_grid_ts` is a float32 tensor).
        frames = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64)
        tt, hh, ww = np.meshgrid(frames, np.arange(gh), np.arange(gw), indexing="ij")
        out[:, start : start + length] = np.stack([tt.ravel(), hh.ravel(), ww.ravel()]) + next_pos
        # Text after an item resumes past its spatial extent, whatever its temporal one.
        next_pos += max(gh, gw)
        cursor = start + length
    out[:, cursor:] = np.arange(next_pos, next_pos + num_tokens - cursor)
    return out, (int(out.max()) + 1 - num_tokens) if num_tokens else 0
