"""Paged-attention test cases: requests whose context sits in shuffled cache blocks, surrounded by
garbage they must not read, and a dense float64 reference."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ferrollm.attention.backend import allocate_kv_cache


def build_case(specs, block_size, num_heads, num_kv_heads, head_dim, dtype, seed):
    """A paged cache holding each request's context in shuffled blocks.

    Args:
        specs: ``(num_computed_tokens, query_len)`` per request.

    Returns:
        (query, new keys, new values, cache, step arrays, dense (keys, values) per request).
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [nc + ql for nc, ql in specs]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 3  # + null block 0 + two spare
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables = np.zeros((len(specs), max(blocks_per_req)), dtype=np.int32)
    for row, n in enumerate(blocks_per_req):
        tables[row, :n] = [ids.pop() for _ in range(n)]
    cache = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim, dtype)[0]
    # Garbage everywhere a request must not look, null block included.
    cache.copy_(torch.randn(cache.shape, generator=gen) * 10)

    dense, queries, new_k, new_v, slots = [], [], [], [], []
    for row, (nc, ql) in enumerate(specs):
        k = torch.randn(nc + ql, num_kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(nc + ql, num_kv_heads, head_dim, generator=gen).to(dtype)
        dense.append((k, v))
        pos = np.arange(nc + ql)
        row_slots = torch.from_numpy(tables[row, pos // block_size] * block_size + pos % block_size)
        # Cached context goes straight in; the new tokens go through write_kv below.
        cache[0].view(-1, num_kv_heads, head_dim)[row_slots[:nc].long()] = k[:nc]
        cache[1].view(-1, num_kv_heads, head_dim)[row_slots[:nc].long()] = v[:nc]
        queries.append(torch.randn(ql, num_heads, head_dim, generator=gen).to(dtype))
        new_k.append(k[nc:])
        new_v.append(v[nc:])
        slots.append(row_slots[nc:].numpy().astype(np.int64))

    step = SimpleNamespace(
        slot_mapping=np.concatenate(slots),
        block_tables=tables,
        query_start_loc=np.concatenate([[0], np.cumsum([ql for _, ql in specs])]).astype(np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        num_computed_tokens=np.array([nc for nc, _ in specs], dtype=np.int32),
    )
    return torch.cat(queries), torch.cat(new_k), torch.cat(new_v), cache, step, dense


def dense_reference(query, dense, specs, scale, sliding_window=None, soft_cap=None):
    """Per-request attention over the dense context, in float64."""
    outs, start = [], 0
    for (k, v), (nc, ql) in zip(dense, specs):
        q = query[start:start + ql].double()
        start += ql
        group = q.shape[1] // k.shape[1]
        kk = k.double().repeat_interleave(group, dim=1)
        vv = v.double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * scale
        if soft_cap is not None:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        qpos = torch.arange(nc, nc + ql)[:, None]
        kpos = torch.arange(nc + ql)[None, :]
        mask = kpos <= qpos
        if sliding_window is not None:
            mask &= kpos > qpos - sliding_window
        scores = scores.masked_fill(~mask, float("-inf"))
        outs.append(torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv))
    return torch.cat(outs)


CASES = {
    "decode_only": [(5, 1), (17, 1), (0, 1), (31, 1), (8, 1)],
    "fresh_prefill": [(0, 7), (0, 16), (0, 3)],
    "prefix_hit": [(16, 9), (32, 1), (8, 20)],
    "chunk_mid_block": [(13, 6), (5, 11)],
    "mixed": [(40, 1), (0, 12), (21, 1), (9, 5), (3, 1)],
}
