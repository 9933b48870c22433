"""Symmetric weight-only int4 rows (GPTQ's and compressed-tensors' W4A16 default) held on the CPU
as GGUF Q4_0 blocks, where the CPU runs those blocks' 16-row group product (AVX512-VNNI) and the
blocks hold the weight exactly.

Why: at one row of activations, the weight-only kernel (`kernels.cpu.quant.wq_linear`) walks one
weight row at a time, and every row pays its own unpacking, scaling and horizontal sum. On the
2-core Xeon it streamed int4 rows at ~5 GB/s a thread, cold or hot in cache, with its float loop
or with an AVX512-VNNI loop tried in its place, where the interleaved Q4_0 product (one
`vpdpbusd` advancing 16 rows) streamed ~10 (24 Qwen2-0.5B-shaped layers, one thread). A W4A16
decode step spent ~25 ms on int4 weights that memory serves in ~9.

A Q4_0 block is 32 elements: an f16 scale `d` and 16 bytes whose byte `i` holds element `i` in
its low nibble and `i + 16` in its high one (`pack_int4`'s order), standing for `d (q - 8)`: a
symmetric weight, whose mins are `-8 · scale`. A group of `g` elements becomes `g / 32` blocks
with the group's scale: 18 bytes per 32 weights, as the weight-only form's at groups of 128 (16
bytes of values and 8 of scale and min per group).

Exactness: a layer becomes blocks only where its scales are f16 values, so the blocks hold the
checkpoint's weights bit for bit: GPTQ stores fp16 scales, compressed-tensors the model's dtype
(an fp16 model's; a bf16 one's within f16's range). fp32 scales, zero points (AWQ, asymmetric
GPTQ: `-zero · scale` seldom fits an f16 min), groups that are not whole blocks and act order
keep the weight-only form. What moves is the activations: the product meets them as two 8-bit
parts per block (their 8 bits, and the 8 bits of what those leave: `gguf_linear_stacked`'s
``residual``), within `max|x_b| / 254²` of each element of block `b`, finer than bf16's 2⁻⁸
(vLLM's CPU backend runs W4A16 in bf16 only). ``FERROLLM_CPU_INT4_BLOCKS=0`` keeps the
weight-only form everywhere (to compare the two).
"""

from __future__ import annotations

import os

import torch

from ferrollm.model_executor.layers.quantization import qweights as qw

__all__ = ["as_blocks", "from_blocks"]

GGML_Q4_0 = 2
BLOCK = 32
BLOCK_BYTES = 18
# Q4_0's stored values are `q - 8`: a symmetric weight's mins are this many scales below zero.
Q4_0_OFFSET = 8


def as_blocks(w: qw.IntWeight) -> qw.GGUFWeight | None:
    """``w`` as Q4_0 blocks where this CPU runs their group product and the blocks hold ``w``
    exactly (symmetric, f16 scales, whole blocks per group, no act order; see the module doc);
    else None."""
    from ferrollm.kernels.cpu.gguf import interleave_preferred

    if (w.bits != 4 or w.perm is not None or w.mins is None or w.group_size % BLOCK or w.q.shape[1] % BLOCK
            or os.environ.get("FERROLLM_CPU_INT4_BLOCKS") == "0"):
        return None
    scales = w.scales.float()
    symmetric = torch.equal(w.mins.float(), -Q4_0_OFFSET * scales)
    if not (symmetric and torch.equal(scales.half().float(), scales) and interleave_preferred(GGML_Q4_0)):
        return None
    out_features, in_features = w.q.shape
    blocks = in_features // BLOCK
    q = w.q.view(out_features, blocks, BLOCK)
    nibbles = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    d = scales.repeat_interleave(w.group_size // BLOCK, dim=1).half().view(torch.uint8).view(out_features, blocks, 2)
    data = torch.cat([d, nibbles], dim=2).reshape(out_features, blocks * BLOCK_BYTES)
    return qw.GGUFWeight(data, GGML_Q4_0, in_features, BLOCK, BLOCK_BYTES)


def from_blocks(w: qw.GGUFWeight, group_size: int) -> qw.IntWeight:
    """The weight-only form back from `as_blocks`' blocks (for saving sharded state): the same
    values, scales and mins it was made from."""
    out_features = w.data.shape[0]
    blocks = w.data.view(out_features, -1, BLOCK_BYTES)
    d = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1).float()
    nibbles = blocks[..., 2:]
    q = torch.cat([nibbles & 15, nibbles >> 4], dim=2).reshape(out_features, -1).contiguous()
    scales = d[:, ::group_size // BLOCK].contiguous()
    return qw.IntWeight(q, scales, -Q4_0_OFFSET * scales, 4, group_size)
