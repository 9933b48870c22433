"""SigLIP's vision encoder (``SiglipVisionModel`` without its pooling head), as Gemma 3 uses it:
a conv patch embedding with learned absolute positions, pre-norm ViT blocks with full
(bidirectional) attention inside each image, and a final LayerNorm.

Parameter names are transformers' below ``vision_model.`` (``embeddings.patch_embedding``,
``encoder.layers.N.self_attn.q_proj``, ``post_layernorm``, ...), so a checkpoint's tensors load
by name. Costs: one batched pass over ``[num_images, 3, image_size, image_size]``; attention is
O(patches**2) per image and head.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ferrollm.exceptions import CheckpointError

__all__ = ["SiglipVisionModel"]


class _Embeddings(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.patch_embedding = nn.Conv2d(config.num_channels, config.hidden_size, config.patch_size,
                                         stride=config.patch_size)
        num_patches = (config.image_size // config.patch_size) ** 2
        self.position_embedding = nn.Embedding(num_patches, config.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(-1, (self.num_heads, -1)).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x)))
        return self.out_proj(out.transpose(1, 2).flatten(2))


class _MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.fc1 = nn.Linear(config.hidden_size, config.intermediate_size)
        self.fc2 = nn.Linear(config.intermediate_size, config.hidden_size)
        # SigLIP's configs say "gelu_pytorch_tanh"; plain "gelu" is the exact erf form.
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate=self.approximate))


class _EncoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.self_attn = _Attention(config)
        self.layer_norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(config) for _ in range(config.num_hidden_layers))


class SiglipVisionModel(nn.Module):
    """SigLIP's ViT: ``[n, 3, H, W]`` images to ``[n, patches, hidden]`` last hidden states.

    Args:
        config: the HF ``SiglipVisionConfig``.
        dtype: parameter dtype.
    """

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)
        self.post_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.to(dtype)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies ``(name, tensor)`` pairs named as this module's parameters (a checkpoint's
        names below ``vision_model.``); returns the names loaded.

        Raises:
            CheckpointError: an unknown, mis-shaped or missing tensor.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.startswith("head."):
                continue  # the pooling head (vision_use_head): Gemma 3 reads the patch states
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
