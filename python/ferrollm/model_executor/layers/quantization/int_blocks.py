"""Symmetric weight-only int4 and int8 rows (GPTQ's and compressed-tensors' W4A16 and W8A16
defaults) held on the CPU as GGUF Q4_0 and Q8_0 blocks, where the CPU runs those blocks' 16-row
group product (AVX512-VNNI) and the blocks hold the weight exactly.

Why: at one row of activations, the weight-only kernel (`kernels.cpu.quant.wq_linear`) walks one
weight row at a time, and every row pays its own unpacking, scaling and horizontal sum. On the
2-core Xeon it streamed int4 rows at ~5 GB/s a thread, cold or hot in cache, with its float loop
or with an AVX512-VNNI loop tried in its place, where the interleaved Q4_0 product (one
`vpdpbusd` advancing 16 rows) streamed ~10 (24 Qwen2-0.5B-shaped layers, one thread). A W4A16
decode step spent ~25 ms on int4 weights that memory serves in ~9.

A block is 32 elements and an f16 scale `d`. Q4_0 keeps 16 bytes whose byte `i` holds element `i`
in its low nibble and `i + 16` in its high one (`pack_int4`'s order), standing for `d (q - 8)`: a
symmetric int4 weight, whose mins are `-8 · scale`; Q8_0 keeps 32 signed bytes, standing for
`d q`: a symmetric int8 weight, without mins. A group of `g` elements becomes `g / 32` blocks with
the group's scale: Q4_0 takes 18 bytes per 32 weights, as the weight-only form at groups of 128
(16 bytes of values, 8 of scale and min per group); Q8_0 34 against 33.

Exactness: a layer becomes blocks only where its scales are f16 values, so the blocks hold the
checkpoint's weights bit for bit: GPTQ stores fp16 scales, compressed-tensors the model's dtype
(an fp16 model's; a bf16 one's within f16's range). fp32 scales, zero points (AWQ, asymmetric
GPTQ: `-zero · scale` seldom fits an f16 min), groups that are not whole blocks and act order
keep the weight-only form. What moves is the activations: the product meets them as two 8-bit
parts per block (their 8 bits, and the 8 bits of what those leave: `gguf_linear_stacked`'s
``residual``), within `max|x_b| / 254²` of each element of block `b`, finer than bf16's 2⁻⁸
(vLLM's CPU backend runs W4A16 in bf16 only). ``FERROLLM_CPU_INT_BLOCKS=0`` keeps the
weight-only form everywhere (to compare the two).
"""

from __future__ import annotations

import os

import torch

from ferrollm.model_executor.ggml_types import block_size
from ferrollm.model_executor.layers.quantization import qweights as qw

__all__ = ["as_blocks", "from_blocks"]

GGML_Q4_0 = 2
GGML_Q8_0 = 8
BLOCK = 32
# Q4_0's stored values are `q - 8`: a symmetric weight's mins are this many scales below zero.
Q4_0_OFFSET = 8


def as_blocks(w: qw.IntWeight) -> qw.GGUFWeight | None:
    """``w`` as Q4_0 (4 bits) or Q8_0 (8 bits) blocks where this CPU runs their group product and
    the blocks hold ``w`` exactly (symmetric, f16 scales, whole blocks per group, no act order;
    see the module doc); else None."""
    from ferrollm.kernels.cpu.gguf import interleave_preferred

    if (w.perm is not None or w.group_size % BLOCK or w.q.shape[1] % BLOCK
            or os.environ.get("FERROLLM_CPU_INT_BLOCKS") == "0"):
        return None
    scales = w.scales.float()
    if w.bits == 4:
        symmetric, ggml_type = w.mins is not None and torch.equal(w.mins.float(), -Q4_0_OFFSET * scales), GGML_Q4_0
    else:
        symmetric, ggml_type = w.mins is None or not bool(w.mins.any()), GGML_Q8_0
    if not (symmetric and torch.equal(scales.half().float(), scales) and interleave_preferred(ggml_type)):
        return None
    out_features, in_features = w.q.shape
    blocks = in_features // BLOCK
    q = w.q.contiguous().view(out_features, blocks, BLOCK)
    values = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4) if w.bits == 4 else q.view(torch.uint8)
    d = scales.repeat_interleave(w.group_size // BLOCK, dim=1).half().view(torch.uint8).view(out_features, blocks, 2)
    block_len, block_bytes = block_size(ggml_type)
    data = torch.cat([d, values], dim=2).reshape(out_features, blocks * block_bytes)
    return qw.GGUFWeight(data, ggml_type, in_features, block_len, block_bytes)


def from_blocks(w: qw.GGUFWeight, group_size: int) -> qw.IntWeight:
    """The weight-only form back from `as_blocks`' blocks (for saving sharded state): the same
    values and scales, the mins of a symmetric weight (8 bits: none)."""
    out_features = w.data.shape[0]
    blocks = w.data.view(out_features, -1, w.block_bytes)
    d = blocks[..., :2].contiguous().view(torch.float16).squeeze(-1).float()
    scales = d[:, ::group_size // BLOCK].contiguous()
    values = blocks[..., 2:]
    if w.ggml_type == GGML_Q8_0:
        return qw.IntWeight(values.contiguous().view(torch.int8).reshape(out_features, -1), scales, None, 8, group_size)
    q = torch.cat([values & 15, values >> 4], dim=2).reshape(out_features, -1).contiguous()
    return qw.IntWeight(q, scales, -Q4_0_OFFSET * scales, 4, group_size)
