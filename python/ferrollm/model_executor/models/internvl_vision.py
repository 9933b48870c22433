"""InternViT, the vision encoder of transformers' ``InternVLForConditionalGeneration`` (the "-hf"
checkpoints): a conv patch embedding with a CLS token and learned absolute positions, pre-norm
ViT blocks (LayerNorm or RMSNorm, optional q/k RMSNorm, layer-scale ``lambda_1``/``lambda_2``)
with full attention inside each tile, and a final LayerNorm unless ``use_mean_pooling``.

Parameter names are transformers' below ``vision_tower.`` (``embeddings.patch_embeddings.projection``,
``encoder.layer.N.attention.q_proj``, ``lambda_1``, ...), so a checkpoint's tensors load by name.
Every tile is ``image_size`` square (the processor tiles to it), so the position table is used
as it is, never interpolated. Costs: one batched pass over ``[tiles, 3, image_size, image_size]``;
attention is O(patches**2) per tile and head.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ferrollm.exceptions import CheckpointError

__all__ = ["InternVisionModel"]


def _pair(value) -> tuple[int, int]:
    return (int(value[0]), int(value[1])) if isinstance(value, (list, tuple)) else (int(value), int(value))


class _RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _norm(config: PretrainedConfig) -> nn.Module:
    if config.norm_type == "rms_norm":
        return _RMSNorm(config.hidden_size, config.layer_norm_eps)
    return nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


class _PatchEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        patch = _pair(config.patch_size)
        self.projection = nn.Conv2d(config.num_channels, config.hidden_size, patch, stride=patch)


class _Embeddings(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        (h, w), (ph, pw) = _pair(config.image_size), _pair(config.patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))
        if getattr(config, "use_mask_token", False):
            self.mask_token = nn.Parameter(torch.zeros(1, 1, config.hidden_size))  # training only; loads by name
        self.patch_embeddings = _PatchEmbeddings(config)
        self.position_embeddings = (nn.Parameter(torch.zeros(1, (h // ph) * (w // pw) + 1, config.hidden_size))
                                    if config.use_absolute_position_embeddings else None)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        proj = self.patch_embeddings.projection
        x = proj(pixel_values.to(proj.weight.dtype)).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        return x if self.position_embeddings is None else x + self.position_embeddings


class _Attention(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden, bias=bias), nn.Linear(hidden, hidden, bias=bias)
        self.v_proj, self.projection_layer = nn.Linear(hidden, hidden, bias=bias), nn.Linear(hidden, hidden)
        qk_norm = bool(config.use_qk_norm)
        self.q_norm = _RMSNorm(hidden) if qk_norm else nn.Identity()
        self.k_norm = _RMSNorm(hidden) if qk_norm else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

        q, k = heads(self.q_norm(self.q_proj(x))), heads(self.k_norm(self.k_proj(x)))
        out = F.scaled_dot_product_attention(q, k, heads(self.v_proj(x)))
        return self.projection_layer(out.transpose(1, 2).flatten(2))


class _MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class _Layer(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.attention = _Attention(config)
        self.mlp = _MLP(config)
        self.layernorm_before, self.layernorm_after = _norm(config), _norm(config)
        self.lambda_1 = nn.Parameter(torch.ones(config.hidden_size))
        self.lambda_2 = nn.Parameter(torch.ones(config.hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.lambda_1 * self.attention(self.layernorm_before(x))
        return x + self.lambda_2 * self.mlp(self.layernorm_after(x))


class _Encoder(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_hidden_layers))


class InternVisionModel(nn.Module):
    """InternViT: ``[tiles, 3, H, W]`` to ``[tiles, 1 + patches, hidden]`` hidden states.

    Args:
        config: the HF ``InternVLVisionConfig``.
        feature_layer: transformers' ``vision_feature_layer``: -1 is the last layer after the
            final norm; another index picks that entry of (embeddings, layer 1, ..., layer N)
            and the later layers are not built.
        dtype: parameter dtype.
    """

    def __init__(self, config: PretrainedConfig, feature_layer: int = -1, dtype: torch.dtype = torch.float32):
        super().__init__()
        n = int(config.num_hidden_layers)
        if not -(n + 1) <= feature_layer <= n:
            raise CheckpointError(f"`vision_feature_layer` must be in [{-(n + 1)}, {n}]. Given: {feature_layer}")
        self.final = feature_layer == -1
        self.num_layers = n if self.final else feature_layer % (n + 1)
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)
        del self.encoder.layer[self.num_layers:]
        self.layernorm = (nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
                          if self.final and not config.use_mean_pooling else nn.Identity())
        self.to(dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layer:
            x = layer(x)
        return self.layernorm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies ``(name, tensor)`` pairs named as this module's parameters (tensors of the
        layers past ``feature_layer`` are skipped); returns the names loaded.

        Raises:
            CheckpointError: an unknown, mis-shaped or missing tensor.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            parts = name.split(".")
            if name.startswith("encoder.layer.") and int(parts[2]) >= self.num_layers:
                continue
            if name.startswith("layernorm.") and not isinstance(self.layernorm, nn.LayerNorm):
                continue
            param = params.get(name)
            if param is None or param.shape != tensor.shape:
                shape = None if param is None else tuple(param.shape)
                raise CheckpointError(f"vision tensor `{name}`: expected shape {shape}. Given: {tuple(tensor.shape)}")
            with torch.no_grad():
                param.copy_(tensor)
            loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise CheckpointError(f"the checkpoint lacks vision tensors {missing[:5]} ({len(missing)} in all)")
        return loaded
