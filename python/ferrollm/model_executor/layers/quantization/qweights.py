"""One projection's quantized weight in a format-neutral layout, as the loaders pass it on.

Every checkpoint format (compressed-tensors, GPTQ, AWQ, fp8, GGUF) is decoded at load into one of
these, oriented like a float weight (``[out_features, in_features]``). They behave enough like a
2-D tensor for the linear layers' loaders to shard them as they shard float weights: ``shape``,
``dim()``, ``narrow`` (rows for column-parallel layers, columns for row-parallel ones) and
``split`` (checkpoints that store q/k/v or gate/up fused). `cat` joins the row blocks of a layer
(q, k, v; gate, up) into the one weight its product reads.

Costs: decoding keeps values one per byte until the layer is complete (a 4-bit layer is then
packed by its kernel form), so loading holds one layer's unpacked bytes at a time.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ferrollm.exceptions import CheckpointError

__all__ = ["Fp8Weight", "GGUFWeight", "Int8ActWeight", "IntWeight", "QuantizedWeight", "cat"]


class _Rows:
    """Row/column slicing shared by the layouts: subclasses name their per-row and per-column
    tensors and how many columns one column of each covers."""

    shape: tuple[int, int]

    def dim(self) -> int:
        return 2

    @property
    def dtype(self) -> torch.dtype:  # the loaders' shape checks read it for messages only
        return torch.uint8

    def narrow(self, dim: int, start: int, length: int):
        if start == 0 and length == self.shape[dim]:
            return self
        if dim == 0:
            return self._rows(start, length)
        return self._cols(start, length)

    def split(self, sizes: list[int]):
        parts, at = [], 0
        for size in sizes:
            parts.append(self.narrow(0, at, size))
            at += size
        return parts

    def _rows(self, start: int, length: int):
        raise NotImplementedError

    def _cols(self, start: int, length: int):
        raise NotImplementedError


def _check_aligned(what: str, start: int, length: int, unit: int, total: int) -> None:
    """A slice of columns (or rows) must cover whole quantization groups (or blocks)."""
    if start % unit or (length % unit and start + length != total):
        raise CheckpointError(
            f"tensor parallelism splits a quantized weight at {what} {start}..{start + length}, which "
            f"cuts its groups of {unit}; the group size must divide the shard's {length} {what}s "
            f"(choose a `tensor_parallel_size` that does)")


@dataclass
class IntWeight(_Rows):
    """Weight-only integers: ``w[n, k] = q[n, k] * scales[n, g] + mins[n, g]``, ``g = k // group_size``.

    Attributes:
        q: uint8 ``[out, in]`` (``bits == 4``: values 0..15) or int8 ``[out, in]`` (``bits == 8``).
        scales: float32 ``[out, in // group_size]``.
        mins: float32 like ``scales``, or None (symmetric 8-bit).
        bits: 4 or 8.
        group_size: columns per scale.
        perm: act-order (GPTQ ``desc_act``): the product reads ``x[:, perm]``, and the columns of
            ``q`` are stored in that order, so groups are contiguous. None when in order.
    """

    q: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group_size: int
    perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:  # type: ignore[override]
        return tuple(self.q.shape)  # type: ignore[return-value]

    def _rows(self, start: int, length: int) -> IntWeight:
        mins = None if self.mins is None else self.mins.narrow(0, start, length)
        return dataclasses.replace(self, q=self.q.narrow(0, start, length),
                                   scales=self.scales.narrow(0, start, length), mins=mins)

    def _cols(self, start: int, length: int) -> IntWeight:
        if self.perm is not None:
            raise CheckpointError("GPTQ act-order (desc_act) weights cannot be split by input features "
                                  "over tensor-parallel ranks; load them with tensor_parallel_size=1")
        g = self.group_size
        _check_aligned("column", start, length, g, self.shape[1])
        mins = None if self.mins is None else self.mins.narrow(1, start // g, -(-length // g))
        return dataclasses.replace(self, q=self.q.narrow(1, start, length),
                                   scales=self.scales.narrow(1, start // g, -(-length // g)), mins=mins)

    def in_whole_groups(self) -> IntWeight:
        """The same weight with groups that divide its inputs, as the kernels take them.

        GPTQ tools quantize any width: groups of 128 over SmolLM2's 576 inputs leave a last group
        of 64 (the file's ``scales`` have 5 columns). Such a weight becomes groups of
        ``gcd(group_size, in_features)`` (64 there; the whole row where it is shorter than one
        group), each group's scale and min repeated over its pieces: the same values, exactly.

        Raises:
            CheckpointError: that common size is not one the kernels take (16 or a multiple of 32).
        """
        k, g = self.shape[1], self.group_size
        if k % g == 0:
            return self
        unit = k if k < g else math.gcd(g, k)
        if unit != k and unit != 16 and unit % 32:
            raise CheckpointError(
                f"a quantized weight's group_size ({g}) neither divides its in_features ({k}) nor "
                f"shares with it a group size the kernels take (16 or a multiple of 32; the largest "
                f"common one is {unit})")
        pieces = lambda t: t.repeat_interleave(g // unit, dim=1)[:, :k // unit].contiguous()  # noqa: E731
        return dataclasses.replace(self, scales=pieces(self.scales),
                                   mins=None if self.mins is None else pieces(self.mins), group_size=unit)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight in checkpoint column order (reference and saving)."""
        expand = lambda t: t.repeat_interleave(self.group_size, dim=1)[:, :self.shape[1]]  # noqa: E731
        w = self.q.float() * expand(self.scales)
        if self.mins is not None:
            w += expand(self.mins)
        if self.perm is not None:
            out = torch.empty_like(w)
            out[:, self.perm] = w
            w = out
        return w


@dataclass
class Int8ActWeight(_Rows):
    """W8A8: int8 weights with a scale per output row; activations are quantized to int8 as the
    product runs, per token (``input_scale`` None) or with a static per-tensor scale and zero point.
    """

    q: torch.Tensor  # int8 [out, in]
    scale: torch.Tensor  # float32 [out]
    input_scale: float | None = None
    input_zero_point: int = 0

    @property
    def shape(self) -> tuple[int, int]:  # type: ignore[override]
        return tuple(self.q.shape)  # type: ignore[return-value]

    def _rows(self, start: int, length: int) -> Int8ActWeight:
        return dataclasses.replace(self, q=self.q.narrow(0, start, length), scale=self.scale.narrow(0, start, length))

    def _cols(self, start: int, length: int) -> Int8ActWeight:
        return dataclasses.replace(self, q=self.q.narrow(1, start, length))

    def dequantize(self) -> torch.Tensor:
        return self.q.float() * self.scale[:, None]


@dataclass
class Fp8Weight(_Rows):
    """float8_e4m3fn weights (as uint8) with a scale per output row, or per ``block`` tile
    (``scale`` ``[ceil(out / bo), ceil(in / bi)]``).

    ``input_quant`` says how activations are quantized as the product runs: ``"tensor"``
    (dynamic, one scale), ``"token"`` (dynamic, a scale per row), ``"group"`` (dynamic, per row
    and ``bi`` columns), ``"static"`` (``input_scale``) or ``"none"`` (float activations).
    """

    q: torch.Tensor  # uint8 [out, in], e4m3 bit patterns
    scale: torch.Tensor
    block: tuple[int, int] | None = None
    input_quant: str = "tensor"
    input_scale: float | None = None

    @property
    def shape(self) -> tuple[int, int]:  # type: ignore[override]
        return tuple(self.q.shape)  # type: ignore[return-value]

    def _rows(self, start: int, length: int) -> Fp8Weight:
        if self.block is None:
            return dataclasses.replace(self, q=self.q.narrow(0, start, length),
                                       scale=self.scale.narrow(0, start, length))
        bo = self.block[0]
        _check_aligned("row", start, length, bo, self.shape[0])
        return dataclasses.replace(self, q=self.q.narrow(0, start, length),
                                   scale=self.scale.narrow(0, start // bo, -(-length // bo)))

    def _cols(self, start: int, length: int) -> Fp8Weight:
        if self.block is None:
            return dataclasses.replace(self, q=self.q.narrow(1, start, length))
        bi = self.block[1]
        _check_aligned("column", start, length, bi, self.shape[1])
        return dataclasses.replace(self, q=self.q.narrow(1, start, length),
                                   scale=self.scale.narrow(1, start // bi, -(-length // bi)))

    def dequantize(self) -> torch.Tensor:
        w = self.q.view(torch.float8_e4m3fn).float()
        if self.block is None:
            return w * self.scale[:, None]
        bo, bi = self.block
        s = self.scale.repeat_interleave(bo, 0)[:w.shape[0]].repeat_interleave(bi, 1)[:, :w.shape[1]]
        return w * s


@dataclass
class GGUFWeight(_Rows):
    """llama.cpp blocks as the file stores them: ``data`` is uint8 ``[out, row_bytes]``, usually a
    view of the file's mapping (each row ``in_features / block_len`` blocks of ``ggml_type``)."""

    data: torch.Tensor
    ggml_type: int
    in_features: int
    block_len: int
    block_bytes: int

    @property
    def shape(self) -> tuple[int, int]:  # type: ignore[override]
        return (self.data.shape[0], self.in_features)

    def _rows(self, start: int, length: int) -> GGUFWeight:
        return dataclasses.replace(self, data=self.data.narrow(0, start, length))

    def _cols(self, start: int, length: int) -> GGUFWeight:
        _check_aligned("column", start, length, self.block_len, self.in_features)
        first, count = start // self.block_len, length // self.block_len
        return dataclasses.replace(self, data=self.data.narrow(1, first * self.block_bytes, count * self.block_bytes),
                                   in_features=length)

    def dequantize(self) -> torch.Tensor:
        from ferrollm.kernels.cpu.gguf import dequantize

        data = self.data.contiguous().numpy()
        return dequantize(data, self.ggml_type, (self.shape[0], self.in_features))

    def as_int(self) -> IntWeight:
        """The same weight as codes and group scales, exactly (`gguf_blocks`), for kernels that
        read those rather than the file's blocks."""
        from ferrollm.model_executor.layers.quantization.gguf_blocks import int_weight

        return int_weight(self.data, self.ggml_type, self.in_features)


QuantizedWeight = IntWeight | Int8ActWeight | Fp8Weight | GGUFWeight


def cat(parts: list[QuantizedWeight]) -> QuantizedWeight | list[GGUFWeight]:
    """One weight from row blocks of the same layout (a layer's q, k, v or gate, up), in order.

    GGUF blocks stay apart (a list): a file may store q, k and v in different block types, and
    each is read where the file holds it.

    Raises:
        CheckpointError: the blocks were quantized differently (naming what differs).
    """
    first = parts[0]
    kinds = {type(p).__name__ for p in parts}
    if len(kinds) > 1:
        raise CheckpointError(f"the projections fused into one layer are quantized differently: {sorted(kinds)}")
    if isinstance(first, GGUFWeight):
        return list(parts)  # type: ignore[arg-type]
    if len(parts) == 1:
        return first
    if isinstance(first, IntWeight):
        return _cat_int(parts)  # type: ignore[arg-type]
    if isinstance(first, Int8ActWeight):
        scales = {p.input_scale for p in parts}  # type: ignore[union-attr]
        return Int8ActWeight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]),  # type: ignore[union-attr]
                             _shared_input_scale(scales), first.input_zero_point)
    return _cat_fp8(parts)  # type: ignore[arg-type]


def _cat_int(parts: list[IntWeight]) -> IntWeight:
    """Joins projections quantized alike, or in different widths and group sizes (a GGUF
    Q4_K_M file's q/k Q4_K beside v Q6_K; compressed-tensors groups of their own): those take
    the widest codes and the common group, values unchanged (`_widened`)."""
    first = parts[0]
    for p in parts[1:]:
        if (p.perm is None) != (first.perm is None) or (p.perm is not None and not torch.equal(p.perm, first.perm)):
            raise CheckpointError("fused projections (q/k/v or gate/up) have different act-order g_idx; "
                                  "they read the same input, so GPTQ gives them one order")
    bits = max(p.bits for p in parts)
    group = math.gcd(*(p.group_size for p in parts))
    parts = [_widened(p, bits, group) for p in parts]
    has_mins = any(p.mins is not None for p in parts)
    mins = [p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts] if has_mins else None
    return IntWeight(torch.cat([p.q for p in parts]), torch.cat([p.scales for p in parts]),
                     None if mins is None else torch.cat(mins), bits, group, first.perm)


def _widened(w: IntWeight, bits: int, group_size: int) -> IntWeight:
    """``w`` with ``bits``-bit codes and groups of ``group_size`` (which divides its own), the
    same values: 4-bit codes (0..15, offsets in the mins) are valid int8 codes, and each scale
    and min repeats over the smaller groups it covers."""
    q = w.q.to(torch.int8) if bits != w.bits else w.q
    if group_size == w.group_size:
        return dataclasses.replace(w, q=q, bits=bits)
    groups, times = -(-w.shape[1] // group_size), w.group_size // group_size
    scales = w.scales.repeat_interleave(times, dim=1)[:, :groups]
    mins = None if w.mins is None else w.mins.repeat_interleave(times, dim=1)[:, :groups]
    return dataclasses.replace(w, q=q, scales=scales, mins=mins, bits=bits, group_size=group_size)


def _cat_fp8(parts: list[Fp8Weight]) -> Fp8Weight:
    first = parts[0]
    if any((p.block, p.input_quant) != (first.block, first.input_quant) for p in parts):
        raise CheckpointError("fused fp8 projections differ in block size or activation scheme")
    if first.block is not None:
        _ = [_check_aligned("row", 0, p.shape[0], first.block[0], -1) for p in parts[:-1]]
    return Fp8Weight(torch.cat([p.q for p in parts]), torch.cat([p.scale for p in parts]), first.block,
                     first.input_quant, _shared_input_scale({p.input_scale for p in parts}))


def _shared_input_scale(scales: set[float | None]) -> float | None:
    """Fused projections read one input, so one static scale serves them: the largest (vLLM's
    choice too), which never clips what the others' range admits."""
    values = [s for s in scales if s is not None]
    return max(values) if values else None
