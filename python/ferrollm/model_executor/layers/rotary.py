"""Rotary position embedding with a cos/sin table precomputed for every position.

Supported RoPE types: ``default``, ``linear`` (position interpolation) and ``llama3`` (Llama 3.1's
frequency-dependent scaling). Both scalings act on the inverse frequencies, so they only change
the table and cost nothing per step.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ferrollm.kernels import cpu as cpu_kernels
from ferrollm.exceptions import UnsupportedModelError

__all__ = ["RotaryEmbedding", "get_rope", "rope_parameters"]

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


class RotaryEmbedding(nn.Module):
    """Rotates the first ``rotary_dim`` features of each query and key head by its position.

    Args:
        head_size: size of one head.
        rotary_dim: features rotated (``head_size`` unless partial rotary).
        max_position: positions the table covers.
        base: ``rope_theta``.
        is_neox_style: rotate the two halves (GPT-NeoX, HF Llama) rather than even/odd pairs (GPT-J).
        dtype: dtype of the table, normally the model's (HF rounds cos/sin to it too).
        scaling: the ``rope_parameters`` dict for ``linear``/``llama3`` scaling, or ``None``.
    """

    def __init__(self, head_size: int, rotary_dim: int, max_position: int, base: float,
                 is_neox_style: bool = True, dtype: torch.dtype | None = None,
                 scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_size = head_size
        self.rotary_dim = rotary_dim
        self.is_neox_style = is_neox_style
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        inv_freq = _scale_inv_freq(inv_freq, scaling)
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype or torch.get_default_dtype())
        # Not persistent: it is derived from the config, never read from checkpoints.
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Applies the rotation.

        Args:
            positions: int64 ``[num_tokens]``.
            query: ``[num_tokens, num_heads * head_size]``.
            key: ``[num_tokens, num_kv_heads * head_size]``.

        Returns:
            Rotated ``(query, key)``, same shapes (on the CPU, NeoX style, fp32/bf16: one Rust
            kernel call each).
        """
        if self.is_neox_style and cpu_kernels.rotary_supported(positions, self.cos_sin_cache, query, key):
            dims = (self.head_size, self.rotary_dim)
            return (cpu_kernels.rotary_neox(query, positions, self.cos_sin_cache, *dims),
                    cpu_kernels.rotary_neox(key, positions, self.cos_sin_cache, *dims))
        cos, sin = self.cos_sin_cache.index_select(0, positions).chunk(2, dim=-1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.view(shape[0], -1, self.head_size)
        cos, sin = cos[:, None], sin[:, None]
        if self.is_neox_style:
            return self._rotate_halves(x, cos, sin).view(shape)
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rot = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        return torch.cat([rot, rest], dim=-1).view(shape)

    def _rotate_halves(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """NeoX style (`x`: ``[tokens, heads, head_size]``), written straight into one output:
        four multiply(-add) kernels instead of eight element-wise ops and two concatenations
        (~5% of a profiled CPU prefill step)."""
        half = self.rotary_dim // 2
        x1, x2 = x[..., :half], x[..., half : self.rotary_dim]
        if torch.compiler.is_compiling():
            # torch.compile cannot trace `out=` into strided views; it fuses this form anyway.
            rest = x[..., self.rotary_dim :]
            return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)
        out = torch.empty_like(x)
        out1, out2 = out[..., :half], out[..., half : self.rotary_dim]
        torch.mul(x1, cos, out=out1).addcmul_(x2, sin, value=-1)
        torch.mul(x2, cos, out=out2).addcmul_(x1, sin)
        if self.rotary_dim < self.head_size:
            out[..., self.rotary_dim :] = x[..., self.rotary_dim :]
        return out

    def extra_repr(self) -> str:
        return (f"head_size={self.head_size}, rotary_dim={self.rotary_dim}, "
                f"max_position={self.cos_sin_cache.shape[0]}, neox={self.is_neox_style}")


def _scale_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any] | None) -> torch.Tensor:
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        # Dividing positions by `factor` equals dividing the frequencies by it.
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise UnsupportedModelError(
        f"rope_type {rope_type!r} is not supported; supported: {list(SUPPORTED_ROPE_TYPES)}"
    )


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1: long wavelengths are divided by ``factor``, short ones kept, and the band in
    between interpolated smoothly."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_len / wavelen - low) / (high - low)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > old_len / low, inv_freq / factor, interpolated)
    return torch.where(wavelen < old_len / high, inv_freq, out)


def rope_parameters(config: Any) -> dict[str, Any]:
    """The RoPE settings of an HF config as one dict, whichever transformers version wrote it.

    transformers >= 5 keeps them in ``config.rope_parameters``; older configs have ``rope_theta``
    and an optional ``rope_scaling`` dict whose type key is ``type`` or ``rope_type``.

    Returns:
        A dict with at least ``rope_type`` and ``rope_theta``, plus the scaling fields and
        ``partial_rotary_factor`` when the config rotates only part of each head.
    """
    params = dict(getattr(config, "rope_parameters", None) or {})
    params.update(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    # GPT-NeoX configs written before transformers 5 name the base and the rotated fraction
    # `rotary_emb_base` and `rotary_pct`; others keep `partial_rotary_factor` at the top level.
    theta = getattr(config, "rope_theta", None) or getattr(config, "rotary_emb_base", None)
    params.setdefault("rope_theta", theta or 10000.0)
    for key in ("partial_rotary_factor", "rotary_pct"):
        if getattr(config, key, None) is not None:
            params.setdefault("partial_rotary_factor", getattr(config, key))
    if params["rope_type"] == "llama3":
        params.setdefault("original_max_position_embeddings", config.max_position_embeddings)
    return params


# Set on an HF config by the loader: the engine's `max_model_len`, past which no position runs.
MAX_MODEL_LEN_ATTR = "_ferrollm_max_model_len"


def rope_max_position(config) -> int:
    """Positions the cos/sin table must cover: ``max_position_embeddings``, but no more than the
    engine's ``max_model_len`` (a 128k-position table of a 256-wide head is 128 MiB in fp32).
    RoPE scaling still reads the config's own lengths (see :func:`rope_parameters`)."""
    limit = getattr(config, MAX_MODEL_LEN_ATTR, None)
    return config.max_position_embeddings if limit is None else min(config.max_position_embeddings, limit)


def get_rope(head_size: int, max_position: int, rope_params: dict[str, Any],
             rotary_dim: int | None = None, is_neox_style: bool = True,
             dtype: torch.dtype | None = None) -> RotaryEmbedding:
    """Builds the rotary embedding a config asks for.

    Args:
        head_size: size of one head.
        max_position: positions to precompute (``max_position_embeddings``).
        rope_params: from :func:`rope_parameters`.
        rotary_dim: features rotated; default ``head_size * partial_rotary_factor``.
        is_neox_style: half-split rotation (True) or interleaved pairs.
        dtype: the model dtype.

    Returns:
        The module.

    Raises:
        UnsupportedModelError: for a RoPE type other than ``default``, ``linear``, ``llama3``.
    """
    if rotary_dim is None:
        rotary_dim = int(head_size * rope_params.get("partial_rotary_factor", 1.0))
    return RotaryEmbedding(head_size, rotary_dim, max_position, rope_params["rope_theta"],
                           is_neox_style, dtype, rope_params)
