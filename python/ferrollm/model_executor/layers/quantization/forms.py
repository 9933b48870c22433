"""The form a quantized linear layer keeps its weight in, and its product.

Built once per layer from the `qweights` row blocks its loaders collected (q, k, v; gate, up; this
rank's slice), then kept as the only copy: packed for the CPU kernels (`ferrollm.kernels.cpu.quant`,
`ferrollm.kernels.cpu.gguf`) or the Triton ones (`ferrollm.kernels.triton.quant`) by the device the
weight lives on. On the CPU, GGUF blocks stay views of the file's mapping, except Q4_0, Q4_1 and
Q8_0 where the CPU runs their 16-row group product (AVX512-VNNI): those are re-laid once
(`ferrollm.kernels.cpu.gguf.interleave`, the same bytes) and the file's pages handed back; on
such CPUs symmetric weight-only int4/int8 rows with fp16 scales become Q4_0/Q8_0 blocks
(`int_blocks`). For the Triton kernels GGUF blocks become weight-only integers
(`GGUFWeight.as_int`, exact), after the loaders sharded them.

Products take float activations ``[rows, in]`` in the model's dtype; the CPU kernels compute in
float32, so a bf16 model's rows are converted on the way in and out.
"""

from __future__ import annotations

import dataclasses
import itertools
import os

import torch

from ferrollm.model_executor.layers.quantization import int_blocks
from ferrollm.model_executor.layers.quantization import qweights as qw

__all__ = ["QuantizedLinear", "build_quantized_form"]


class QuantizedLinear:
    """One layer's quantized weight and the kernel that multiplies by it."""

    def __init__(self, weight: qw.QuantizedWeight | list[qw.GGUFWeight], device: torch.device,
                 backend: str | None = None, residual_activations: bool = False):
        """``backend``: ``"cpu"`` (the Rust kernels) or ``"triton"``; by default the device's
        (the tests run the Triton kernels on CPU tensors under ``TRITON_INTERPRET=1``).
        ``residual_activations``: GGUF blocks meet the activations' 8-bit values and their 8-bit
        residual (`gguf_linear_stacked`'s ``residual``), for the LM head."""
        self.source = weight
        self.device = device
        self.residual_activations = residual_activations
        self.on_cpu = (backend or ("cpu" if device.type == "cpu" else "triton")) == "cpu"
        self._prepare()

    # -- building ----------------------------------------------------------------------------

    def _prepare(self) -> None:
        w = self.source
        # The file's bytes of GGUF blocks held as integers here (the start-up log compares them).
        self.gguf_file_bytes = 0
        if isinstance(w, list) and not self.on_cpu:
            # The Triton kernels read codes and group scales: the blocks as those, exactly.
            # Decoded on the device, so only the file's bytes cross to it.
            self.gguf_file_bytes = sum(s.data.numel() for s in w)
            runs = _same_form_runs([dataclasses.replace(s, data=s.data.to(self.device)).as_int() for s in w])
            if len(runs) > 1:
                self._prepare_parts(runs)
                return
            w = self.source = qw.cat(runs[0])
        if isinstance(w, qw.IntWeight):
            w = self.source = w.in_whole_groups()
        # Symmetric weight-only int4/int8 rows as Q4_0/Q8_0 blocks where the CPU runs those
        # faster (`int_blocks`); their group size, to give them back in their own form on saving.
        self.int_group: int | None = None
        if self.on_cpu and isinstance(w, qw.IntWeight) and (blocks := int_blocks.as_blocks(w)) is not None:
            self.int_group = w.group_size
            self.residual_activations = True
            w = self.source = [blocks]
        if isinstance(w, list):  # GGUF segments, each read where the file holds it (CPU only)
            self.kind = "gguf"
            # Stacked along the output features in one kernel call (q, k, v; gate, up).
            self.segments = [_gguf_segment(s) for s in w]
            self.out_features, self.in_features = sum(s.data.shape[0] for s in w), w[0].in_features
            # Interleaved segments hold the only copy: their source keeps just its shape.
            self.source = [s if isinstance(g, tuple) else _shape_only(s) for s, g in zip(w, self.segments)]
            return
        self.kind = type(w).__name__
        on_cpu = self.on_cpu
        dev = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        self.out_features, self.in_features = w.q.shape
        if isinstance(w, qw.IntWeight):
            if w.bits == 8:
                self.packed = dev(w.q.contiguous())
            else:
                self.packed = _kernels(on_cpu).pack_int4(w.q) if on_cpu else dev(_pack_int4_pairs(w.q))
            # The unpacked values are not kept: `packed` is the weight's only copy.
            self.source = qw.IntWeight(torch.empty(0), dev(w.scales.contiguous().float()),
                                       dev(None if w.mins is None else w.mins.contiguous().float()),
                                       w.bits, w.group_size, dev(w.perm))
        elif isinstance(w, qw.Int8ActWeight):
            self.packed = _kernels(on_cpu).w8a8_pack(w.q.contiguous()) if on_cpu else dev(w.q.contiguous())
            self.source = qw.Int8ActWeight(torch.empty(0, dtype=torch.int8), dev(w.scale.contiguous()),
                                           self._input_scale(w.input_scale), w.input_zero_point)
        elif isinstance(w, qw.Fp8Weight):
            self.packed = dev(w.q.contiguous())
            self.source = qw.Fp8Weight(torch.empty(0, dtype=torch.uint8), dev(w.scale.contiguous()), w.block,
                                       w.input_quant, self._input_scale(w.input_scale))
            self.unit_scale = self._input_scale(1.0)  # per-token inputs: rows already e4m3

    def _prepare_parts(self, runs: list[list[qw.IntWeight]]) -> None:
        """A fused layer whose projections differ in form (a Q4_K_M file's q/k Q4_K beside v
        Q6_K): one form per run of alike projections, their outputs side by side. Joined into
        one weight, every row would take the widest form (the Q4_K rows 12 bits a weight
        instead of 6)."""
        self.kind = "parts"
        self.parts = [QuantizedLinear(qw.cat(run), self.device, backend="triton") for run in runs]
        self.out_features = sum(part.out_features for part in self.parts)
        self.in_features = self.parts[0].in_features
        self.source = None

    def _input_scale(self, scale: float | None):
        """A static activation scale as each kernel family takes it: a float for the Rust
        kernels, a one-element float32 tensor on the device for the Triton ones (made once here:
        a copy from the host inside a captured CUDA graph would be an error)."""
        if scale is None or self.on_cpu:
            return scale
        return torch.tensor([scale], dtype=torch.float32, device=self.device)

    # -- the product -------------------------------------------------------------------------

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        dtype = x.dtype
        if self.on_cpu and dtype != torch.float32:
            x = x.float()
            bias = None if bias is None else bias.float()
        y = self._product(x if x.is_contiguous() else x.contiguous(), bias)
        # Guarded: a no-op `.to` is still a dispatch, and this runs for the LM head every step.
        return y if y.dtype == dtype else y.to(dtype)

    def _product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        k = _kernels(self.on_cpu)
        w = self.source
        if self.kind == "parts":
            widths = [part.out_features for part in self.parts]
            biases = [None] * len(widths) if bias is None else bias.split(widths)
            return torch.cat([part._product(x, b) for part, b in zip(self.parts, biases)], dim=-1)
        if self.kind == "gguf":
            from ferrollm.kernels.cpu.gguf import gguf_linear_stacked

            return gguf_linear_stacked(x, self.segments, self.in_features, bias, self.residual_activations)
        if isinstance(w, qw.IntWeight):
            if w.perm is not None:
                x = x[:, w.perm].contiguous()
            return k.wq_linear(x, self.packed, w.scales, w.mins, w.bits, w.group_size, bias)
        if isinstance(w, qw.Int8ActWeight):
            return k.w8a8_linear(x, self.packed, w.scale, bias, w.input_scale, w.input_zero_point)
        assert isinstance(w, qw.Fp8Weight)
        if w.input_quant == "token":
            return _fp8_per_token(k, x, self.packed, w, bias, self.unit_scale)
        return k.fp8_linear(x, self.packed, w.scale, bias, w.block, w.input_quant, w.input_scale)

    # -- what the rest of the engine asks ----------------------------------------------------

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (any shape) of a weight-only integer form for the Triton kernels, in
        float32 (``[*ids.shape, in_features]``): a GGUF vocabulary table kept as integers off the
        CPU looks its embeddings up here."""
        w = self.source
        if self.on_cpu or not isinstance(w, qw.IntWeight):
            raise TypeError(f"rows() reads a weight-only integer form for the Triton kernels, not {self.kind}")
        flat = ids.reshape(-1)
        q = self.packed[flat]
        if w.bits == 4:
            q = _unpack_int4(q, self.in_features, cpu_layout=False)
        mins = None if w.mins is None else w.mins[flat]
        rows = qw.IntWeight(q, w.scales[flat], mins, w.bits, w.group_size).dequantize()
        return rows.reshape(*ids.shape, self.in_features)

    def saved_weight(self) -> qw.QuantizedWeight | list[qw.GGUFWeight]:
        """The weight in the `qweights` layout again, read back from the kernels' packing (for
        saving sharded state)."""
        w = self.source
        if self.kind == "parts":  # saved as one weight: the parts' forms joined in the widest
            return qw.cat([part.saved_weight() for part in self.parts])
        if self.kind == "gguf" or isinstance(w, list):
            segments = [s if isinstance(g, tuple) else _deinterleaved(s, g) for s, g in zip(w, self.segments)]
            if self.int_group is not None:
                return int_blocks.from_blocks(segments[0], self.int_group)
            return segments
        in_features = self.in_features
        if isinstance(w, qw.IntWeight):
            q = self.packed if w.bits == 8 else _unpack_int4(self.packed, in_features, self.on_cpu)
            return qw.IntWeight(q, w.scales, w.mins, w.bits, w.group_size, w.perm)
        if isinstance(w, qw.Int8ActWeight):
            q = _unpack_w8a8(self.packed, self.out_features, in_features) if self.on_cpu else self.packed
            return qw.Int8ActWeight(q, w.scale, w.input_scale, w.input_zero_point)
        assert isinstance(w, qw.Fp8Weight)
        return qw.Fp8Weight(self.packed, w.scale, w.block, w.input_quant, w.input_scale)

    def segment_tensors(self) -> list[torch.Tensor]:
        """The tensors a GGUF form's product reads (file views or interleaved copies)."""
        return [s[0] if isinstance(s, tuple) else s.data for s in getattr(self, "segments", [])]

    def tensors(self) -> dict[int, int]:
        """Bytes held, by address (for the start-up log's weight bytes)."""
        if self.kind == "parts":
            return {address: size for part in self.parts for address, size in part.tensors().items()}
        held = [self.packed] if hasattr(self, "packed") else self.segment_tensors()
        w = self.source
        for name in ("scales", "mins", "scale"):
            t = getattr(w, name, None)
            if isinstance(t, torch.Tensor):
                held.append(t)
        return {t.data_ptr(): t.numel() * t.element_size() for t in held if t.numel()}


def _same_form_runs(weights: list[qw.IntWeight]) -> list[list[qw.IntWeight]]:
    """Consecutive weights grouped by form (bits, group size, whether they have mins): each run
    joins into one weight without widening any."""
    return [list(run) for _, run in itertools.groupby(weights, key=lambda w: (w.bits, w.group_size, w.mins is None))]


def _gguf_segment(w: qw.GGUFWeight):
    """A GGUF weight as the block product reads it: re-laid in 16-row groups where this CPU runs
    those (the file's pages then handed back), else the file's own blocks.
    ``FERROLLM_GGUF_INTERLEAVE=0`` keeps the file's blocks (to compare the two)."""
    from ferrollm.kernels.cpu.gguf import interleave, interleave_preferred
    from ferrollm.model_executor.layers.cpu_weights import release_pages

    if not interleave_preferred(w.ggml_type) or w.data.shape[0] == 0 or os.environ.get("FERROLLM_GGUF_INTERLEAVE") == "0":
        return (w.data, w.ggml_type)
    blocks = interleave(w.data, w.ggml_type, w.in_features)
    release_pages(w.data)
    return blocks


def _shape_only(w: qw.GGUFWeight) -> qw.GGUFWeight:
    return dataclasses.replace(w, data=torch.empty((w.data.shape[0], 0), dtype=torch.uint8))


def _deinterleaved(w: qw.GGUFWeight, blocks) -> qw.GGUFWeight:
    from ferrollm.kernels.cpu.gguf import deinterleave

    return dataclasses.replace(w, data=deinterleave(blocks, w.in_features))


def _fp8_per_token(k, x: torch.Tensor, weight: torch.Tensor, w: qw.Fp8Weight, bias: torch.Tensor | None,
                   unit_scale) -> torch.Tensor:
    """Per-token dynamic fp8 inputs (compressed-tensors' FP8_DYNAMIC): each row is rounded to e4m3
    with its own scale (``max |x_r| / 448``) here, the kernel multiplies the already-e4m3 rows
    with a unit static scale (an exact no-op rounding), and the row scales apply to the product."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    rows = (x / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype)
    y = k.fp8_linear(rows, weight, w.scale, None, w.block, "static", unit_scale) * scale
    return y if bias is None else y + bias


FP8_MAX = 448.0


def _pack_int4_pairs(q: torch.Tensor) -> torch.Tensor:
    """The Triton kernels' int4 layout: byte ``k // 2`` of a row holds value ``k`` in its low
    nibble for even ``k`` and in its high one for odd ``k``."""
    if q.shape[1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def _unpack_int4(packed: torch.Tensor, in_features: int, cpu_layout: bool) -> torch.Tensor:
    """uint8 ``[out, in]`` values from either kernel family's int4 packing: the CPU's 32-element
    blocks (byte ``i`` holds element ``i`` low and ``i + 16`` high) or Triton's nibble pairs."""
    low, high = packed & 15, packed >> 4
    if cpu_layout:
        blocks = packed.shape[1] // 16
        values = torch.cat([low.view(-1, blocks, 16), high.view(-1, blocks, 16)], dim=2)
    else:
        values = torch.stack([low, high], dim=-1)
    return values.reshape(packed.shape[0], -1)[:, :in_features].contiguous()


def _unpack_w8a8(packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """int8 ``[out, in]`` from `w8a8_pack`'s tiles: 16 features, 4 consecutive inputs of each."""
    tiles, k_padded = -(-out_features // 16), -(-in_features // 4) * 4
    body = packed[: tiles * 16 * k_padded].view(tiles, k_padded // 4, 16, 4)
    return body.permute(0, 2, 1, 3).reshape(tiles * 16, k_padded)[:out_features, :in_features].view(torch.int8).contiguous()


def _kernels(on_cpu: bool):
    if on_cpu:
        from ferrollm.kernels.cpu import quant
        return quant
    from ferrollm.kernels.triton import quant as triton_quant
    return triton_quant


def build_quantized_form(blocks: list[tuple[int, qw.QuantizedWeight]], device: torch.device,
                         residual_activations: bool = False) -> QuantizedLinear:
    """The layer's form from its row blocks, which tile the weight in order (`RowBlocks.ordered`)."""
    return QuantizedLinear(qw.cat([b for _, b in blocks]), device, residual_activations=residual_activations)
