"""The vision encoders of Qwen2-VL and Qwen2.5-VL: patch embedding, a ViT with 2-D rotary
embeddings, and a merger that folds each 2x2 block of patches into one token of the decoder's
width.

Every image of a step is encoded in one call: the patches of all images are concatenated and
attention is restricted to each image (Qwen2-VL) or, in Qwen2.5-VL's windowed blocks, to each
window of an image, by running attention per segment (``cu_seqlens`` boundaries). Weight names
follow the hub's ``visual.*`` tensors with the ``visual.`` prefix removed.

Costs: the encoder is quadratic in each image's patch count (full-attention blocks) and runs in
the model dtype; segments are attended one by one with SDPA, so no mask of the whole step is
ever built.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ferrollm.exceptions import CheckpointError

__all__ = ["Qwen2VisionTransformer", "Qwen2_5_VisionTransformer"]


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTS = {"quick_gelu": _quick_gelu, "gelu": F.gelu, "silu": F.silu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX-style rotation in float32 (`x`: ``[tokens, heads, head_dim]``)."""
    dtype, x = x.dtype, x.float()
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(dtype)


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment of ``cu_seqlens``."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, cu_seqlens: list[int], cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)
        for start, end in itertools.pairwise(cu_seqlens):
            seg = [t[start:end].transpose(0, 1) for t in (q, k, v)]
            out[start:end] = F.scaled_dot_product_attention(*seg).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class _Block(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp: nn.Module, norm: type[nn.Module]):
        super().__init__()
        self.norm1 = norm(dim, eps=1e-6)
        self.norm2 = norm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x, cu_seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class _Mlp(nn.Module):
    """Qwen2-VL's ``fc2(act(fc1(x)))``."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), _ACTS[act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class _GatedMlp(nn.Module):
    """Qwen2.5-VL's ``down(act(gate(x)) * up(x))``, with biases."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj, self.act = nn.Linear(hidden, dim), _ACTS[act]

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class _Merger(nn.Module):
    """Norm, then each ``merge x merge`` block of patches (adjacent rows) through a 2-layer MLP."""

    def __init__(self, out_dim: int, dim: int, merge: int, norm: type[nn.Module]):
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = norm(dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.width))


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL's encoder: every block attends over each whole image.

    Args:
        config: the HF ``Qwen2VLVisionConfig``.
        out_dim: the decoder's hidden size (the merger's output width).
        dtype: parameter dtype.
    """

    def __init__(self, config, out_dim: int, dtype: torch.dtype):
        super().__init__()
        dim, heads = config.embed_dim, config.num_heads
        self._init_common(config, dim, heads)
        hidden = int(dim * config.mlp_ratio)
        self.blocks = nn.ModuleList(_Block(dim, heads, _Mlp(dim, hidden, config.hidden_act), nn.LayerNorm)
                                    for _ in range(config.depth))
        self.merger = _Merger(out_dim, dim, self.merge, nn.LayerNorm)
        self.to(dtype)

    def _init_common(self, config, dim: int, heads: int) -> None:
        self.merge = config.spatial_merge_size
        self.patch_size = config.patch_size
        self.temporal_patch_size = config.temporal_patch_size
        self.in_channels = config.in_channels
        kernel = (config.temporal_patch_size, config.patch_size, config.patch_size)
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv3d(config.in_channels, dim, kernel, stride=kernel, bias=False)
        theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        # Half of each head rotates by the row, half by the column.
        half = dim // heads // 2
        inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def embed_patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[num_patches, C * T * P * P]`` flattened patches -> ``[num_patches, dim]``."""
        proj = self.patch_embed.proj
        x = pixel_values.to(proj.weight.dtype).view(-1, self.in_channels, self.temporal_patch_size,
                                                      self.patch_size, self.patch_size)
        return proj(x).view(x.shape[0], -1)

    def rotary(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin ``[num_patches, 1, head_dim]`` of every patch's (row, column), patches ordered
        as the processor emits them: merge blocks row-major, patches inside a block row-major."""
        rows = []
        for t, h, w in grids:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            block = (h // self.merge, self.merge, w // self.merge, self.merge)
            hw = torch.stack([hh.reshape(block).transpose(1, 2).flatten(),
                              ww.reshape(block).transpose(1, 2).flatten()], dim=-1)
            rows.append(hw.repeat(t, 1))
        pos = torch.cat(rows).to(self.inv_freq.device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # row frequencies, then column
        emb = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return emb.cos(), emb.sin()

    @staticmethod
    def image_seqlens(grids: list[tuple[int, int, int]]) -> list[int]:
        """Segment boundaries of full attention: one segment per frame of each item."""
        bounds = [0]
        for t, h, w in grids:
            bounds.extend(bounds[-1] + h * w * (i + 1) for i in range(t))
        return bounds

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        """Encodes the step's items.

        Args:
            pixel_values: the items' patches concatenated, as the image processor makes them.
            grids: each item's (t, h, w) patch grid, in the same order.

        Returns:
            ``[sum(t * h * w) / merge**2, out_dim]`` embeddings, items in order.
        """
        x = self.embed_patches(pixel_values)
        cos, sin = self.rotary(grids)
        bounds = self.image_seqlens(grids)
        for blk in self.blocks:
            x = blk(x, bounds, cos, sin)
        return self.merger(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies ``visual.*`` tensors (prefix removed) into the parameters."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            param = params.get(name)
            if param is None:
                raise CheckpointError(f"checkpoint tensor 'visual.{name}' has no parameter in {type(self).__name__}")
            if param.shape != tensor.shape:
                raise CheckpointError(f"checkpoint tensor 'visual.{name}' has shape {tuple(tensor.shape)}; "
                                      f"the model expects {tuple(param.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(f"the checkpoint lacks {len(missing)} vision tensors, e.g. {missing[:5]}")
        return loaded


class Qwen2_5_VisionTransformer(Qwen2VisionTransformer):
    """Qwen2.5-VL's encoder: RMSNorm, gated MLPs, and attention inside windows of
    ``window_size`` pixels except in the ``fullatt_block_indexes`` blocks. Patches are reordered
    window by window before the blocks (so each window is one contiguous segment) and put back
    after the merger."""

    def __init__(self, config, out_dim: int, dtype: torch.dtype):
        nn.Module.__init__(self)
        dim, heads = config.hidden_size, config.num_heads
        self._init_common(config, dim, heads)
        self.window_size = config.window_size
        self.full_blocks = set(config.fullatt_block_indexes)
        self.blocks = nn.ModuleList(_Block(dim, heads, _GatedMlp(dim, config.intermediate_size, config.hidden_act),
                                           _RMSNorm) for _ in range(config.depth))
        self.merger = _Merger(out_dim, dim, self.merge, _RMSNorm)
        self.to(dtype)

    def window_order(self, grids: list[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """The merge units reordered window by window (windows row-major, units row-major inside
        each), and the windows' patch boundaries."""
        side = self.window_size // self.merge // self.patch_size
        unit = self.merge * self.merge
        order, bounds, base = [], [0], 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            index = torch.arange(t * gh * gw).view(t, gh, gw) + base
            for frame in range(t):
                for r in range(0, gh, side):
                    for c in range(0, gw, side):
                        window = index[frame, r : r + side, c : c + side].flatten()
                        order.append(window)
                        bounds.append(bounds[-1] + window.numel() * unit)
            base += t * gh * gw
        return torch.cat(order), bounds

    def forward(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> torch.Tensor:
        x = self.embed_patches(pixel_values)
        cos, sin = self.rotary(grids)
        order, window_bounds = self.window_order(grids)
        order = order.to(x.device)
        unit = self.merge * self.merge

        def by_window(t: torch.Tensor) -> torch.Tensor:
            return t.view(-1, unit, *t.shape[1:])[order].flatten(0, 1)

        x, cos, sin = by_window(x), by_window(cos), by_window(sin)
        # Windows never cross items, so the full-attention segments stay the items' own.
        full_bounds = self.image_seqlens(grids)
        for i, blk in enumerate(self.blocks):
            x = blk(x, full_bounds if i in self.full_blocks else window_bounds, cos, sin)
        return self.merger(x)[torch.argsort(order)]
