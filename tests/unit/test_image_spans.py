"""`attend_image_spans`: the rows of an image's tokens get attention under transformers' Gemma 3
mask (causal, or inside the same image; AND the sliding window), read from the paged cache,
also when a prefix-cache hit ends inside the image."""

from __future__ import annotations

import pytest
import torch
from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.image_spans import attend_image_spans

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def _dense(q, k, v, q_pos, start, end, window):
    """Reference: the full ``[q, k]`` mask, softmax, values (GQA by repeating kv heads)."""
    kp = torch.arange(k.shape[0])[None, :]
    allowed = (kp <= q_pos[:, None]) | ((kp >= start) & (kp < end))
    if window is not None:
        allowed &= kp > q_pos[:, None] - window
    k, v = k.repeat_interleave(HEADS // KV_HEADS, 1), v.repeat_interleave(HEADS // KV_HEADS, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * DIM**-0.5
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("computed", [0, 6], ids=["no_hit", "hit_inside_image"])
def test_image_rows_see_the_whole_image(window, computed):
    torch.manual_seed(0)
    seq_len, start, end = 14, 3, 11  # one request; its image is tokens 3..10
    blocks = torch.tensor([2, 0, 3, 1])  # shuffled physical blocks
    keys, values = torch.randn(seq_len, KV_HEADS, DIM), torch.randn(seq_len, KV_HEADS, DIM)
    cache = torch.zeros(2, 4, BLOCK, KV_HEADS, DIM)
    pos = torch.arange(seq_len)
    slots = blocks[pos // BLOCK] * BLOCK + pos % BLOCK
    cache.flatten(1, 2)[0, slots], cache.flatten(1, 2)[1, slots] = keys, values
    n = seq_len - computed
    meta = AttentionMetadata(slot_mapping=slots[computed:], block_tables=blocks[None].int(),
                             query_start_loc=torch.tensor([0, n]), seq_lens=torch.tensor([seq_len]),
                             num_computed_tokens=torch.tensor([computed]), num_reqs=1, num_tokens=n,
                             max_query_len=n, max_seq_len=seq_len, block_size=BLOCK,
                             image_spans=[(0, start, end)])
    query = torch.randn(n, HEADS, DIM)
    out = torch.full((n, HEADS, DIM), 7.0)  # what the causal backend left: text rows stay as they are
    attend_image_spans(out, query, cache, meta, DIM**-0.5, window, None)
    first = max(start, computed)
    rows = slice(first - computed, end - computed)
    want = _dense(query[rows], keys[:end], values[:end], torch.arange(first, end), start, end, window)
    torch.testing.assert_close(out[rows], want, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[rows] = False
    assert (out[untouched] == 7.0).all()
