"""Fuyu (adept/fuyu-8b): image patches projected straight into a Persimmon decoder, with no
vision encoder. ``vision_embed_tokens`` (a linear map of ``patch_size**2 * num_channels`` pixel
values to the decoder's width) turns each patch into one input embedding.

An image's placeholder run is, as transformers' ``FuyuProcessor`` writes it, one row of
``|SPEAKER|`` tokens (``image_token_id``) per patch row, each row closed by a ``|NEWLINE|`` token.
The whole run is one item, so the runner's spans (chunked prefill, prefix-cache hashes, the input
cache) cover the newlines too; the encoder output has a row for every position of the run, and
only the ``|SPEAKER|`` positions take a patch embedding: the ``|NEWLINE|`` positions keep their
token embedding. The decoder is causal throughout, so an image may span prefill chunks. The
encoder is one linear map, lighter than the decoder step the start-up profile already runs, so
it is not profiled separately.

Checkpoint names: the hub's (``language_model.model.*``, ``language_model.lm_head.*``,
``vision_embed_tokens.*``) and transformers 5's (``model.language_model.*``, ``lm_head.*``,
``model.vision_embed_tokens.*``) both load. With no vision part (``limit_mm_per_prompt`` of 0 for
every modality, or ``language_model_only``) ``vision_embed_tokens`` is not built, and its tensors
are skipped and counted in a log line.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.exceptions import CheckpointError
from ferrollm.model_executor.models.persimmon import PersimmonForCausalLM
from ferrollm.model_executor.models.qwen2_vl import TEXT_ONLY_ATTR
from ferrollm.model_executor.models.utils import LanguageModelDelegate, with_engine_settings

__all__ = ["FuyuForCausalLM"]

logger = logging.getLogger(__name__)


class FuyuForCausalLM(LanguageModelDelegate, nn.Module):
    """Fuyu: patch projection + Persimmon decoder.

    Args:
        config: the HF ``FuyuConfig``.
        dtype: parameter and activation dtype.
    """

    supports_multimodal = True

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.config = config
        self.dtype = dtype
        text = with_engine_settings(config.get_text_config(), config)
        self.language_model: PersimmonForCausalLM = PersimmonForCausalLM(text, dtype)
        self.image_token_id = int(config.image_token_id)
        patch_dim = int(config.patch_size) ** 2 * int(config.num_channels)
        text_only = getattr(config, TEXT_ONLY_ATTR, False)
        self.vision_embed_tokens: nn.Linear | None = (
            None if text_only else nn.Linear(patch_dim, text.hidden_size, dtype=dtype))
        self.adopt_decoder_shape()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: AttentionMetadata,
                mm_embeds: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Runs one step; ``mm_embeds = (rows, embeds)`` are the encoder outputs of the step's
        placeholder rows. Returns the final hidden states ``[num_tokens, hidden_size]``."""
        if mm_embeds is not None:
            rows, values = mm_embeds
            # Only the patch positions take the encoder's rows; |NEWLINE| stays a text token.
            is_patch = input_ids[rows] == self.image_token_id
            mm_embeds = (rows[is_patch], values[is_patch])
        return self.run_decoder(input_ids, positions, kv_caches, attn_metadata, mm_embeds)

    def encode_images(self, pixel_values: torch.Tensor, grids: list[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Projects the step's patches ``[num_patches, patch_dim]`` (image after image, row-major)
        in one call; returns each image's ``[rows * (cols + 1), hidden]`` rows of its placeholder
        run, zero at the ``|NEWLINE|`` positions (which :meth:`forward` leaves to the text)."""
        if self.vision_embed_tokens is None:
            raise RuntimeError("vision_embed_tokens is not loaded (limit_mm_per_prompt is 0 for every modality)")
        embeds = self.vision_embed_tokens(pixel_values.to(self.dtype))
        out = []
        for chunk, (_, rows, cols) in zip(embeds.split([h * w for _, h, w in grids]), grids):
            run = chunk.new_zeros(rows, cols + 1, chunk.shape[-1])
            run[:, :cols] = chunk.view(rows, cols, -1)
            out.append(run.flatten(0, 1))
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads hub or transformers-5 names: ``vision_embed_tokens`` (or skips it when it is
        not built) and the decoder under Persimmon's names."""
        vision: dict[str, torch.Tensor] = {}
        skipped = 0

        def text_weights() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal skipped
            for name, tensor in weights:
                name = name.removeprefix("model.")  # transformers 5 nests everything but lm_head
                if name.startswith("vision_embed_tokens."):
                    if self.vision_embed_tokens is None:
                        skipped += 1
                    else:
                        vision[name.removeprefix("vision_embed_tokens.")] = tensor
                    continue
                yield _persimmon_name(name), tensor

        loaded = {f"language_model.{n}" for n in self.language_model.load_weights(text_weights())}
        if self.vision_embed_tokens is not None:
            try:
                self.vision_embed_tokens.load_state_dict(vision)
            except RuntimeError as e:  # missing, unexpected or mis-shaped tensors
                raise CheckpointError(f"vision_embed_tokens does not match the checkpoint: {e}") from e
            loaded |= {f"vision_embed_tokens.{n}" for n in vision}
        elif skipped:
            logger.info("limit_mm_per_prompt is 0 for every modality (or language_model_only): skipped the %d "
                        "vision_embed_tokens tensors", skipped)
        return loaded


def _persimmon_name(name: str) -> str:
    """A Fuyu checkpoint's decoder tensor name (``model.`` already stripped) under
    ``PersimmonForCausalLM``'s names."""
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "model." + name.removeprefix("language_model.model.")
    if name.startswith("language_model."):
        return "model." + name.removeprefix("language_model.")
    return name
