"""llama.cpp's block types as weight-only integers (`qweights.IntWeight`), for the devices whose
kernels read codes and group scales rather than the file's blocks (the Triton ``wq_linear``).

Every type with a CPU block kernel is an affine code per element with a scale (and a min) per
group of 32 or 16, so it is re-expressed exactly, ``w = q * scale + min``:

=====  ====  =====  ======================  =====================  ==============================
type   bits  group  codes                   scale                  min
=====  ====  =====  ======================  =====================  ==============================
Q8_0   8     32     the int8 values         d                      none
Q4_0   4     32     0..15                   d                      -8 d
Q4_1   4     32     0..15                   d                      m
Q5_0   8     32     q - 16 (int8)           d                      none
Q5_1   8     32     0..31                   d                      m
Q4_K   4     32     0..15                   d * sc (6-bit)         -dmin * m (6-bit)
Q5_K   8     32     0..31                   d * sc (6-bit)         -dmin * m (6-bit)
Q6_K   8     16     q - 32 (int8)           d * sc (int8)          none
=====  ====  =====  ======================  =====================  ==============================

Every product above is exact in float32 (an fp16 value times a code or a 6/8-bit scale has at
most 19 significant bits) and the sums are the ones llama.cpp's dequantizers round, in the same
order, so `IntWeight.dequantize` gives the decoded weight bit for bit.

Costs: codes take a byte each until the form packs the 4-bit ones two to a byte; 5- and 6-bit
codes stay a byte each, and scales and mins are float32. Bits a weight on the device against the
file's: Q8_0 9 (file 8.5), Q4_0 6 (4.5), Q4_1 6 (5), Q5_0 9 (5.5), Q5_1 10 (6), Q4_K 6 (4.5),
Q5_K 10 (5.5), Q6_K 10 (6.5625).

Block layouts are GGML's (``ggml-common.h``); fp16 fields are little-endian, as the files are.
The decoding runs on the device the blocks are on (torch element-wise ops).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.ggml_types import block_size, type_name
from ferrollm.model_executor.layers.quantization.qweights import IntWeight

__all__ = ["device_bits", "expressible", "int_weight"]

# Each decoder takes uint8 blocks [rows, blocks, block_bytes] and returns codes [rows, blocks,
# block_len], scales [rows, blocks, groups] and mins like scales (or None).
_Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]


def int_weight(data: torch.Tensor, ggml_type: int, in_features: int) -> IntWeight:
    """The blocks ``data`` (uint8 ``[rows, row_bytes]``) as codes, scales and mins.

    Raises:
        CheckpointError: a type without an integer form (naming it).
    """
    if ggml_type not in _FORMS:
        raise CheckpointError(f"GGUF type {type_name(ggml_type)} has no weight-only integer form; "
                              f"types with one: {sorted(type_name(t) for t in _FORMS)}")
    decode, bits, group = _FORMS[ggml_type]
    block_len, block_bytes = block_size(ggml_type)
    rows = data.shape[0]
    codes, scales, mins = decode(data.contiguous().view(rows, in_features // block_len, block_bytes))
    return IntWeight(codes.reshape(rows, in_features), scales.reshape(rows, -1).contiguous(),
                     None if mins is None else mins.reshape(rows, -1).contiguous(), bits, group)


def expressible(ggml_type: int | None) -> bool:
    """Whether `int_weight` takes tensors of this GGML type."""
    return ggml_type in _FORMS


def device_bits(ggml_type: int) -> float:
    """Bits a weight of this type takes as `int_weight` gives it, once the 4-bit codes are packed:
    the code and its share of the float32 scale (and min)."""
    _, bits, group = _FORMS[ggml_type]
    return bits + 32 * (1 + (ggml_type in _WITH_MINS)) / group


# -- the decoders ------------------------------------------------------------------------------

def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The fp16 field at byte ``at`` of each block, as float32 ``[rows, blocks, 1]``."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """A legacy block's 16 bytes as its 32 codes: element ``j`` is byte ``j``'s low nibble,
    element ``j + 16`` its high one."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _high_bits(qh: torch.Tensor) -> torch.Tensor:
    """Q5_0/Q5_1's 32-bit field (little-endian) as 32 bits, bit ``j`` for element ``j``, each
    moved to bit 4 (the code's fifth bit)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=qh.device)
    bits = (qh[..., :, None] >> shifts) & 1  # [rows, blocks, byte, bit]
    return bits.flatten(-2) << 4


def _q8_0(blocks: torch.Tensor) -> _Decoded:
    return blocks[..., 2:].view(torch.int8), _f16(blocks, 0), None


def _q4_0(blocks: torch.Tensor) -> _Decoded:
    d = _f16(blocks, 0)
    return _nibbles(blocks[..., 2:]), d, -8 * d


def _q4_1(blocks: torch.Tensor) -> _Decoded:
    return _nibbles(blocks[..., 4:]), _f16(blocks, 0), _f16(blocks, 2)


def _q5_0(blocks: torch.Tensor) -> _Decoded:
    codes = _nibbles(blocks[..., 6:]) | _high_bits(blocks[..., 2:6])
    return codes.view(torch.int8) - 16, _f16(blocks, 0), None


def _q5_1(blocks: torch.Tensor) -> _Decoded:
    codes = _nibbles(blocks[..., 8:]) | _high_bits(blocks[..., 4:8])
    return codes.view(torch.int8), _f16(blocks, 0), _f16(blocks, 2)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's eight 6-bit sub-block scales and mins, from bytes 4..15 of a super-block:
    sub-blocks 0-3 in the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 in
    the nibbles of bytes 8-11, their top two bits in the top bits of bytes 0-7."""
    a, b, c = blocks[..., 4:8], blocks[..., 8:12], blocks[..., 12:16]
    scales = torch.cat([a & 63, (c & 15) | ((a >> 6) << 4)], dim=-1)
    mins = torch.cat([b & 63, (c >> 4) | ((b >> 6) << 4)], dim=-1)
    return scales.float(), mins.float()


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K's 128 code bytes as 256 low 4-bit codes: four runs of 32 bytes, each giving
    64 elements, its low nibbles first."""
    runs = qs.unflatten(-1, (4, 32))
    return torch.stack([runs & 15, runs >> 4], dim=-2).flatten(-3)


def _q4_k(blocks: torch.Tensor) -> _Decoded:
    sc, m = _k_scales(blocks)
    return _k_nibbles(blocks[..., 16:]), _f16(blocks, 0) * sc, -(_f16(blocks, 2) * m)


def _q5_k(blocks: torch.Tensor) -> _Decoded:
    sc, m = _k_scales(blocks)
    # Element l of the 32 in half h of run r takes bit 2r + h of high byte l as its fifth bit.
    shifts = torch.arange(8, dtype=torch.uint8, device=blocks.device)
    high = ((blocks[..., 16:48, None] >> shifts) & 1).transpose(-1, -2).flatten(-2) << 4
    codes = _k_nibbles(blocks[..., 48:]) | high
    return codes.view(torch.int8), _f16(blocks, 0) * sc, -(_f16(blocks, 2) * m)


def _q6_k(blocks: torch.Tensor) -> _Decoded:
    """Two halves of 128 elements, each from 64 low bytes and 32 high bytes: element
    ``32 k + l`` (k = 0..3) takes a nibble of low byte ``l + 32 (k % 2)`` (the high nibble for
    k >= 2) and bits ``2k, 2k+1`` of high byte ``l``."""
    low = blocks[..., :128].unflatten(-1, (2, 2, 32))  # [half, k % 2, l]
    low = torch.stack([low & 15, low >> 4], dim=-3).flatten(-3, -2)  # [half, k, l]
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=blocks.device)[:, None]
    high = (blocks[..., 128:192].unflatten(-1, (2, 1, 32)) >> shifts) & 3  # [half, k, l]
    codes = (low | (high << 4)).flatten(-3).view(torch.int8) - 32
    scales = blocks[..., 192:208].view(torch.int8).float()
    return codes, _f16(blocks, 208) * scales, None


_FORMS: dict[int, tuple[Callable[[torch.Tensor], _Decoded], int, int]] = {
    8: (_q8_0, 8, 32), 2: (_q4_0, 4, 32), 3: (_q4_1, 4, 32), 6: (_q5_0, 8, 32), 7: (_q5_1, 8, 32),
    12: (_q4_k, 4, 32), 13: (_q5_k, 8, 32), 14: (_q6_k, 8, 16),
}
_WITH_MINS = {2, 3, 7, 12, 13}
