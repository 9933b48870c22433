"""Unpacking the int32 words that GPTQ, AWQ and compressed-tensors pack 4- and 8-bit values into.

All three put value ``i`` of a word at bits ``bits * i`` (little-endian order); AWQ also permutes
the eight 4-bit values of each word (`AWQ_ORDER`). Values come out unsigned, one per uint8.
"""

from __future__ import annotations

import torch

from ferrollm.exceptions import CheckpointError

__all__ = ["AWQ_ORDER", "unpack_int32"]

# AWQ's GEMM layout: nibble j of a word holds column AWQ_ORDER[j] of its eight.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, length: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The unsigned ``bits``-bit values packed along ``dim`` of an int32 tensor, as uint8, cut to
    ``length`` along that dimension.

    Args:
        packed: int32 words, 2-D.
        bits: 4 or 8.
        length: values along ``dim`` (the unpacked size, which the packing may have padded).
        dim: the packed dimension (0 or 1).
        order: where each value of a word goes among its ``32 // bits`` (AWQ), default in order.

    Raises:
        CheckpointError: another bit width, or too few words for ``length``.
    """
    if bits not in (4, 8):
        raise CheckpointError(f"packed weights must have 4 or 8 bits. Given: {bits}")
    if packed.dtype != torch.int32:
        raise CheckpointError(f"packed quantized weights must be int32. Given: {packed.dtype}")
    per_word = 32 // bits
    words = packed if dim == 1 else packed.t()
    if words.shape[1] * per_word < length:
        raise CheckpointError(f"{words.shape[1]} packed words hold {words.shape[1] * per_word} values; "
                              f"the weight needs {length}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    values = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    if order is not None:
        values = values[..., torch.argsort(torch.tensor(order))]
    values = values.reshape(words.shape[0], -1)[:, :length].to(torch.uint8)
    return values.contiguous() if dim == 1 else values.t().contiguous()
