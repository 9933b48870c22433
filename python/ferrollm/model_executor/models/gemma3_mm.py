"""Gemma 3 with images (``Gemma3ForConditionalGeneration``): a SigLIP encoder, Gemma 3's
projector (average-pool the patch grid to ``mm_tokens_per_image`` tokens, Gemma RMSNorm, a
linear map into the decoder's width) and the Gemma 3 text decoder on the paged-attention path.

Image embeddings replace the ``<image_soft_token>`` rows after the token embeddings are scaled
(transformers scales only the text rows). The decoder attends bidirectionally inside each image:
the runner marks the step's image spans on the attention metadata (``image_spans``, see
``attention/image_spans.py``) because ``bidirectional_mm_attention`` is set here.

Checkpoint names: the hub's (``vision_tower.vision_model.*``, ``multi_modal_projector.*``,
``language_model.model.*``) and transformers 5's (``model.vision_tower.[vision_model.]*``,
``model.multi_modal_projector.*``, ``model.language_model.*``) both load. With no vision tower
(``limit_mm_per_prompt`` of 0 for every modality, or ``language_model_only``) the vision and
projector tensors are skipped and counted in a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.model_executor.layers.norm import GemmaRMSNorm
from ferrollm.model_executor.models.gemma3 import Gemma3ForCausalLM
from ferrollm.model_executor.models.qwen2_vl import TEXT_ONLY_ATTR
from ferrollm.model_executor.models.siglip import SiglipVisionModel
from ferrollm.model_executor.models.utils import LanguageModelDelegate, with_engine_settings

__all__ = ["Gemma3ForConditionalGeneration"]

logger = logging.getLogger(__name__)


class Gemma3MultiModalProjector(nn.Module):
    """``[n, patches, vision_hidden]`` to ``[n, mm_tokens_per_image, text_hidden]``."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        vision = config.vision_config
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vision.hidden_size, config.text_config.hidden_size, dtype=dtype))
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps, dtype)
        self.patches_per_side = int(vision.image_size // vision.patch_size)
        self.kernel = self.patches_per_side // int(config.mm_tokens_per_image**0.5)

    def forward(self, vision_out: torch.Tensor) -> torch.Tensor:
        n, _, hidden = vision_out.shape
        grid = vision_out.transpose(1, 2).reshape(n, hidden, self.patches_per_side, self.patches_per_side)
        pooled = nn.functional.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled.contiguous()), self.mm_input_projection_weight)


class Gemma3ForConditionalGeneration(LanguageModelDelegate, nn.Module):
    """Gemma 3 (4B and up): SigLIP + projector + Gemma 3 decoder.

    Args:
        config: the HF ``Gemma3Config``.
        dtype: parameter and activation dtype.
    """

    supports_multimodal = True
    # The runner marks image spans so that attention inside an image is bidirectional.
    bidirectional_mm_attention = True

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        text = with_engine_settings(config.get_text_config(), config)
        self.language_model = Gemma3ForCausalLM(text, dtype)
        self.image_token_id = int(config.image_token_id)
        self.vocab_size = int(text.vocab_size)
        self.mm_tokens_per_image = int(config.mm_tokens_per_image)
        text_only = getattr(config, TEXT_ONLY_ATTR, False)
        self.vision_tower = None if text_only else SiglipVisionModel(config.vision_config, dtype)
        self.multi_modal_projector = None if text_only else Gemma3MultiModalProjector(config, dtype)
        self.adopt_decoder_shape()

    # -- the engine's model interface (see CausalLMInterface) ----------------------------------

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Runs one step; ``mm_embeds = (rows, embeds)`` are the image embeddings of the step's
        placeholder rows. Returns the final hidden states ``[num_tokens, hidden_size]``."""
        return self.run_decoder(input_ids, positions, kv_caches, attn_metadata, mm_embeds, self._scaled_embeds)

    def _scaled_embeds(self, input_ids: torch.Tensor) -> torch.Tensor:
        model = self.language_model.model
        # The soft token may lie outside the vocabulary (262144 in the released models).
        embeds = model.embed_tokens(input_ids.masked_fill(input_ids >= self.vocab_size, 0))
        return embeds if model.embed_scale is None else embeds * model.embed_scale

    # -- multimodal ----------------------------------------------------------------------------

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Encodes the step's images ``[n, 3, H, W]`` in one call; returns each image's
        ``[mm_tokens_per_image, hidden]``."""
        if self.vision_tower is None or self.multi_modal_projector is None:
            raise RuntimeError("the vision tower is not loaded (limit_mm_per_prompt is 0 for every modality)")
        out = self.multi_modal_projector(self.vision_tower(pixel_values.to(self.dtype)))
        return list(out.unbind(0))

    def dummy_images(self, num_images: int, device: torch.device) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """Blank pixels of ``num_images`` images, for the start-up profile of the encoder."""
        size = int(self.config.vision_config.image_size)
        return torch.zeros(num_images, 3, size, size, device=device), [(1, 1, 1)] * num_images

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads hub or transformers-5 names: the vision tower, the projector (or skips both
        when there is no vision tower) and the decoder under Gemma 3's text names."""
        vision: list[tuple[str, torch.Tensor]] = []
        projector: dict[str, torch.Tensor] = {}
        skipped = 0

        def text_weights():
            nonlocal skipped
            for name, tensor in weights:
                name = name.removeprefix("model.")
                if name.startswith(("vision_tower.", "multi_modal_projector.")):
                    if self.vision_tower is None:
                        skipped += 1
                    elif name.startswith("vision_tower."):
                        vision.append((name.removeprefix("vision_tower.").removeprefix("vision_model."), tensor))
                    else:
                        projector[name.removeprefix("multi_modal_projector.")] = tensor
                    continue
                if name.startswith("language_model.lm_head."):
                    name = name.removeprefix("language_model.")
                elif name.startswith("language_model.model."):
                    name = "model." + name.removeprefix("language_model.model.")
                elif name.startswith("language_model."):
                    name = "model." + name.removeprefix("language_model.")
                yield name, tensor

        loaded = {f"language_model.{n}" for n in self.language_model.load_weights(text_weights())}
        if self.vision_tower is not None and self.multi_modal_projector is not None:
            loaded |= {f"vision_tower.{n}" for n in self.vision_tower.load_weights(vision)}
            self.multi_modal_projector.load_state_dict(projector)
            loaded |= {f"multi_modal_projector.{n}" for n in projector}
        elif skipped:
            logger.info("limit_mm_per_prompt is 0 for every modality (or language_model_only): skipped the %d "
                        "vision tower and projector tensors", skipped)
        return loaded
