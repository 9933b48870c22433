"""Qwen2-VL and Qwen2.5-VL (``Qwen2VLForConditionalGeneration``,
``Qwen2_5_VLForConditionalGeneration``): a vision encoder whose merged patch embeddings replace
the prompt's image placeholder tokens, and a Qwen2 decoder rotated by M-RoPE (see
``layers/mrope.py``) on the paged-attention path the text models use.

What a multimodal model offers the runner (``worker/mm_state.py``):

- ``encode_images(pixel_values, grids)``: one encoder call over all of a step's new images and
  videos (a video's patches have an image's layout, attended frame group by frame group),
  split back per item;
- ``mrope_positions(num_tokens, items)``: a prompt's (t, h, w) positions and its delta;
- ``forward(..., mm_embeds=(rows, embeds))``: the step's embeddings with ``embeds`` written at
  the flat token ``rows``.

Checkpoint names: the hub's (``visual.*``, ``model.*``, ``lm_head.*``) and transformers 5's
(``model.visual.*``, ``model.language_model.*``) both load. With no vision tower
(``limit_mm_per_prompt`` of 0 for every modality) the ``visual.*`` tensors are skipped.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.model_executor.layers.mrope import MRotaryEmbedding, mrope_positions
from ferrollm.model_executor.layers.rotary import (
    RotaryEmbedding,
    rope_max_position,
    rope_parameters,
)
from ferrollm.model_executor.models.qwen2 import Qwen2ForCausalLM
from ferrollm.model_executor.models.qwen2_vl_vision import (
    Qwen2_5_VisionTransformer,
    Qwen2VisionTransformer,
)
from ferrollm.model_executor.models.utils import LanguageModelDelegate, with_engine_settings
from ferrollm.multimodal.inputs import MultiModalItem

__all__ = ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"]

logger = logging.getLogger(__name__)

# Set on the HF config by the engine when every modality's limit is 0: no vision tower is built.
TEXT_ONLY_ATTR = "_ferrollm_text_only"


class _MRopeQwen2(Qwen2ForCausalLM):
    """The Qwen2 decoder with M-RoPE tables instead of 1-D ones."""

    def _rope(self, params: dict[str, Any], ropes: dict[str, RotaryEmbedding]) -> RotaryEmbedding:
        if "mrope" not in ropes:
            params = dict(params)
            section = params.pop("mrope_section")
            if params.get("rope_type") == "mrope":
                params["rope_type"] = "default"
            rotary_dim = int(self.head_dim * params.get("partial_rotary_factor", 1.0))
            ropes["mrope"] = MRotaryEmbedding(self.head_dim, rotary_dim, rope_max_position(self.config),
                                              params["rope_theta"], list(section), self.dtype, params)
        return ropes["mrope"]


def _text_config(config: PretrainedConfig) -> PretrainedConfig:
    """The decoder's config, with the top-level tying and the M-RoPE sections it needs."""
    text = config.get_text_config()
    text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", getattr(text, "tie_word_embeddings", False)))
    params = rope_parameters(text)
    if "mrope_section" not in params:
        raise ValueError(f"{type(config).__name__} has no `mrope_section` in its RoPE settings")
    return text


class Qwen2VLForConditionalGeneration(LanguageModelDelegate, nn.Module):
    """Qwen2-VL: a ViT over whole images and a Qwen2 decoder with M-RoPE.

    Args:
        config: the HF ``Qwen2VLConfig``.
        dtype: parameter and activation dtype.
    """

    supports_multimodal = True
    vision_cls: type[Qwen2VisionTransformer] = Qwen2VisionTransformer

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        text = with_engine_settings(_text_config(config), config)
        self.language_model = _MRopeQwen2(text, dtype)
        self.image_token_id = int(config.image_token_id)
        self.spatial_merge_size = int(config.vision_config.spatial_merge_size)
        self.visual = None if getattr(config, TEXT_ONLY_ATTR, False) else self.vision_cls(
            config.vision_config, self._vision_out_dim(config), dtype)
        self.adopt_decoder_shape()

    @staticmethod
    def _vision_out_dim(config: PretrainedConfig) -> int:
        return int(config.vision_config.hidden_size)

    # -- the engine's model interface (see CausalLMInterface) ----------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Runs one step.

        Args:
            input_ids: int64 ``[num_tokens]``.
            positions: int64 ``[3, num_tokens]`` M-RoPE positions (``[num_tokens]`` for a step of
                text-only requests, whose three positions are equal).
            kv_caches, attn_metadata: as for the text models.
            mm_embeds: ``(rows, embeds)``: the image embeddings of the step's placeholder rows.

        Returns:
            Final hidden states ``[num_tokens, hidden_size]``.
        """
        lm = self.language_model
        embeds = None
        if mm_embeds is not None:
            rows, values = mm_embeds
            embeds = lm.model.embed_tokens(input_ids)
            embeds[rows] = values.to(embeds.dtype)
        return lm.model(input_ids, positions, kv_caches, attn_metadata, inputs_embeds=embeds)

    # -- multimodal ----------------------------------------------------------------------------

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Encodes the step's images and videos in one call; returns each item's ``[tokens, hidden]``."""
        if self.visual is None:
            raise RuntimeError("the vision tower is not loaded (limit_mm_per_prompt is 0 for every modality)")
        out = self.visual(pixel_values, grids)
        sizes = [t * h * w // self.spatial_merge_size**2 for t, h, w in grids]
        return list(out.split(sizes))

    def mrope_positions(self, num_tokens: int, items: list[MultiModalItem]) -> tuple[np.ndarray, int]:
        """A prompt's ``[3, num_tokens]`` M-RoPE positions and the delta of the tokens after it."""
        spans = [(it.offset, it.grid, self._time_interval(it)) for it in items]
        return mrope_positions(num_tokens, spans, self.spatial_merge_size)

    def _time_interval(self, item: MultiModalItem) -> float:
        """Qwen2-VL numbers a video's frame groups 0, 1, 2, ... like an image's single one."""
        return 1.0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads hub or transformers-5 names; ``visual.*`` goes to the encoder (or is skipped
        when there is none), the rest to the decoder under Qwen2's names."""
        vision: list[tuple[str, torch.Tensor]] = []
        skipped = 0

        def text_weights():
            nonlocal skipped
            for name, tensor in weights:
                name = name.removeprefix("model.") if name.startswith("model.visual.") else name
                if name.startswith("visual."):
                    if self.visual is None:
                        skipped += 1
                    else:
                        vision.append((name.removeprefix("visual."), tensor))
                    continue
                yield name.replace("model.language_model.", "model.", 1), tensor

        loaded = {f"language_model.{n}" for n in self.language_model.load_weights(text_weights())}
        if self.visual is not None:
            loaded |= {f"visual.{n}" for n in self.visual.load_weights(vision)}
        elif skipped:
            logger.info("limit_mm_per_prompt is 0 for every modality: skipped the %d vision tensors", skipped)
        return loaded


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    """Qwen2.5-VL: Qwen2-VL with a windowed, RMS-normed, gated-MLP encoder.

    Args:
        config: the HF ``Qwen2_5_VLConfig``.
        dtype: parameter and activation dtype.
    """

    vision_cls = Qwen2_5_VisionTransformer

    def _time_interval(self, item: MultiModalItem) -> float:
        """A video's frame groups sit ``tokens_per_second`` positions per second apart."""
        if item.second_per_grid_t is None:
            return 1.0
        return float(np.float32(self.config.vision_config.tokens_per_second) * np.float32(item.second_per_grid_t))

    @staticmethod
    def _vision_out_dim(config: PretrainedConfig) -> int:
        return int(config.vision_config.out_hidden_size)
