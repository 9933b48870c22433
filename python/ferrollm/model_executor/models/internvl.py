"""InternVL in transformers' layout (``InternVLForConditionalGeneration``, the "-hf" checkpoints):
InternViT (``internvl_vision.py``), a pixel shuffle that folds each 2x2 (``1 / downsample_ratio``)
block of patch features into one wider feature, the ``multi_modal_projector`` (LayerNorm, linear,
GELU, linear) and a Qwen2 or Llama text decoder on the paged-attention path (causal everywhere,
images included).

Each image is one item: its tiles (and thumbnail) are ``[tiles, 3, S, S]`` pixels, and its
``<IMG_CONTEXT>`` run is ``tiles * image_seq_length`` tokens; the item's grid is ``(tiles, 1, 1)``
so that the step's tiles, encoded in one batch, split back per image.

Checkpoint names: the hub's (``vision_tower.*``, ``multi_modal_projector.*``,
``language_model.model.*``, ``language_model.lm_head.*``) and transformers 5's (``model.*``,
``lm_head.*``) both load. With no vision tower (``limit_mm_per_prompt`` of 0 for every modality,
or ``language_model_only``) the vision and projector tensors are skipped and counted in a log line.
``InternVLChatModel`` (OpenGVLab's own layout, e.g. InternVL2 with InternLM2 text) is the same
network under other names: ``internvl_chat.py`` subclasses this class and renames at load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.models.internvl_vision import InternVisionModel
from ferrollm.model_executor.models.llama import LlamaForCausalLM
from ferrollm.model_executor.models.qwen2 import Qwen2ForCausalLM
from ferrollm.model_executor.models.qwen2_vl import TEXT_ONLY_ATTR
from ferrollm.model_executor.models.utils import LanguageModelDelegate, with_engine_settings

__all__ = ["InternVLForConditionalGeneration"]

logger = logging.getLogger(__name__)

_TEXT_MODELS = {"qwen2": Qwen2ForCausalLM, "llama": LlamaForCausalLM}


class InternVLMultiModalProjector(nn.Module):
    """``[tiles, tokens, vision_hidden * fold**2]`` to ``[tiles, tokens, text_hidden]``."""

    def __init__(self, config: PretrainedConfig, fold: int):
        super().__init__()
        width, text = config.vision_config.hidden_size * fold**2, config.text_config.hidden_size
        self.layer_norm = nn.LayerNorm(width)
        self.linear_1, self.linear_2 = nn.Linear(width, text), nn.Linear(text, text)
        self.approximate = "none" if config.projector_hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(self.layer_norm(x)), approximate=self.approximate))


def pixel_shuffle(features: torch.Tensor, fold: int) -> torch.Tensor:
    """``[n, side, side, c]`` to ``[n, side / fold, side / fold, c * fold**2]``, channel order as
    transformers' ``pixel_shuffle`` (which the projector's weights were trained on)."""
    n, rows, cols, c = features.shape
    x = features.reshape(n, rows, cols // fold, c * fold).transpose(1, 2)
    x = x.reshape(n, cols // fold, rows // fold, c * fold * fold).transpose(1, 2)
    return x.contiguous()


class InternVLForConditionalGeneration(LanguageModelDelegate, nn.Module):
    """InternVL (-hf layout): InternViT + pixel shuffle + projector + Qwen2/Llama decoder.

    Args:
        config: the HF ``InternVLConfig``.
        dtype: parameter and activation dtype.

    Raises:
        CheckpointError: a text model other than Qwen2 or Llama, or a feature-selection
            strategy other than ``"default"``.
    """

    supports_multimodal = True
    # Decoder classes by the text config's model_type.
    text_models: dict[str, type[LlamaForCausalLM]] = _TEXT_MODELS

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        text = with_engine_settings(config.get_text_config(), config)
        cls = self.text_models.get(text.model_type)
        if cls is None or config.vision_feature_select_strategy != "default":
            raise CheckpointError(f"InternVL's text model must be one of {sorted(self.text_models)} with "
                                  "vision_feature_select_strategy 'default'. Given: "
                                  f"{text.model_type!r}, {config.vision_feature_select_strategy!r}")
        self.language_model = cls(text, dtype)
        self.image_token_id = int(config.image_token_id)
        self.fold = round(1 / float(config.downsample_ratio))
        text_only = getattr(config, TEXT_ONLY_ATTR, False)
        layer = config.vision_feature_layer
        if isinstance(layer, (list, tuple)):
            raise CheckpointError(f"`vision_feature_layer` must be one int. Given: {layer}")
        self.vision_tower = None if text_only else InternVisionModel(config.vision_config, int(layer), dtype)
        self.multi_modal_projector = (None if text_only else
                                      InternVLMultiModalProjector(config, self.fold).to(dtype))
        self.adopt_decoder_shape()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Runs one step; ``mm_embeds = (rows, embeds)`` are the image embeddings of the step's
        placeholder rows. Returns the final hidden states ``[num_tokens, hidden_size]``."""
        return self.run_decoder(input_ids, positions, kv_caches, attn_metadata, mm_embeds)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Encodes the step's tiles ``[tiles, 3, S, S]`` in one call; returns each image's
        ``[tiles * image_seq_length, hidden]`` (``grids[i][0]`` is image i's tile count)."""
        if self.vision_tower is None or self.multi_modal_projector is None:
            raise RuntimeError("the vision tower is not loaded (limit_mm_per_prompt is 0 for every modality)")
        features = self.vision_tower(pixel_values.to(self.dtype))[:, 1:]  # drop the CLS token
        tiles, patches, hidden = features.shape
        side = int(patches**0.5)
        shuffled = pixel_shuffle(features.reshape(tiles, side, side, hidden), self.fold)
        out = self.multi_modal_projector(shuffled.reshape(tiles, -1, shuffled.shape[-1]))
        return [chunk.flatten(0, 1) for chunk in out.split([g[0] for g in grids])]

    def dummy_images(self, num_images: int, device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Blank single-tile images, for the start-up profile of the encoder."""
        size = self.config.vision_config.image_size
        h, w = (size[0], size[1]) if isinstance(size, (list, tuple)) else (size, size)
        return torch.zeros(num_images, 3, int(h), int(w), device=device), [(1, 1, 1)] * num_images

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads hub or transformers-5 names: the vision tower, the projector (or skips both
        when there is no vision tower) and the decoder under its own text names."""
        vision: list[tuple[str, torch.Tensor]] = []
        projector: dict[str, torch.Tensor] = {}
        skipped = 0

        # transformers ties lm_head to the embedding by the top-level tie_word_embeddings (True
        # unless set) when the checkpoint has no lm_head, whatever the text config says.
        tie_missing_head = bool(getattr(self.config, "tie_word_embeddings", True)) and \
            not self.language_model.tie_word_embeddings
        head_seen, embedding = False, None

        def text_weights():
            nonlocal skipped, head_seen, embedding
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith(("vision_tower.", "multi_modal_projector.")):
                    if self.vision_tower is None:
                        skipped += 1
                    elif name.startswith("vision_tower."):
                        vision.append((name.removeprefix("vision_tower."), tensor))
                    else:
                        projector[name.removeprefix("multi_modal_projector.")] = tensor
                    continue
                if name.startswith("language_model.lm_head."):
                    name = name.removeprefix("language_model.")
                elif name.startswith("language_model.model."):
                    name = "model." + name.removeprefix("language_model.model.")
                elif name.startswith("language_model."):
                    name = "model." + name.removeprefix("language_model.")
                head_seen |= name.startswith("lm_head.")
                embedding = tensor if name == "model.embed_tokens.weight" else embedding
                yield name, tensor
            if tie_missing_head and not head_seen and embedding is not None:
                yield "lm_head.weight", embedding

        loaded = {f"language_model.{n}" for n in self.language_model.load_weights(text_weights())}
        if self.vision_tower is not None and self.multi_modal_projector is not None:
            loaded |= {f"vision_tower.{n}" for n in self.vision_tower.load_weights(vision)}
            self.multi_modal_projector.load_state_dict(projector)
            loaded |= {f"multi_modal_projector.{n}" for n in projector}
        elif skipped:
            logger.info("limit_mm_per_prompt is 0 for every modality (or language_model_only): skipped the %d "
                        "vision tower and projector tensors", skipped)
        return loaded
