"""InternVL's (-hf layout) multimodal processing, through the checkpoint's ``GotOcr2ImageProcessor``
with dynamic tiling on (``crop_to_patches``, as ``InternVLProcessor`` calls it): an image becomes
the tiles of the grid closest to its aspect ratio (``min_patches..max_patches`` tiles) plus a
thumbnail when there is more than one tile.

Each ``<IMG_CONTEXT>`` of a prompt becomes, as ``InternVLProcessor`` writes it, ``<img>`` +
``<IMG_CONTEXT>`` * (tiles * ``image_seq_length``) + ``</img>``; the three are special tokens, so
this is done on token ids. A prompt whose runs are already expanded is taken as it is.

``mm_processor_kwargs``: the image processor's own keys, and vLLM's names ``max_dynamic_patch``
(transformers' ``max_patches``: tiles, not counting the thumbnail), ``min_dynamic_patch``
(``min_patches``) and ``dynamic_image_size`` (``crop_to_patches``).

``InternVLChatModel`` (OpenGVLab's layout) ships no tiling processor: its ``dynamic_preprocess``
(the grid of ``min_dynamic_patch..max_dynamic_patch`` tiles closest to the image's aspect ratio,
then a thumbnail when ``use_thumbnail`` and there is more than one tile, ImageNet mean and std) is
what ``GotOcr2ImageProcessor`` computes with ``crop_to_patches``, so
:class:`InternVLChatMultiModalProcessor` builds one from the model's config. Its prompts carry the
text ``<image>`` (not a token), which becomes ``<IMG_CONTEXT>`` before tokenizing and is expanded
as above, as the model's ``chat`` writes it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ferrollm.exceptions import ConfigError, InvalidRequestError
from ferrollm.multimodal.cache import hash_item
from ferrollm.multimodal.inputs import MultiModalInputs, MultiModalItem
from ferrollm.multimodal.processor import MultiModalProcessor

__all__ = ["InternVLChatMultiModalProcessor", "InternVLMultiModalProcessor"]

_VLLM_NAMES = {"max_dynamic_patch": "max_patches", "min_dynamic_patch": "min_patches",
               "dynamic_image_size": "crop_to_patches"}


class InternVLMultiModalProcessor(MultiModalProcessor):
    """Processes one request's images for ``InternVLForConditionalGeneration`` (arguments as
    :class:`MultiModalProcessor`'s)."""

    placeholders = {"image": "<IMG_CONTEXT>"}

    def __init__(self, folder: Path, hf_config: Any, limits: dict[str, int], default_kwargs: dict[str, Any] | None,
                 *args: Any, **kwargs: Any):
        super().__init__(folder, hf_config, limits, default_kwargs, *args, **kwargs)
        self.tokens_per_tile = int(hf_config.image_seq_length)
        self.start_id, self.end_id = self._start_end_ids(folder)

    def _start_end_ids(self, folder: Path) -> tuple[int, int]:
        return _start_end_ids(folder)

    def _check_kwargs(self, kwargs: dict[str, Any], error: type[Exception]) -> dict[str, Any]:
        renamed = {_VLLM_NAMES.get(k, k): v for k, v in kwargs.items()}
        return super()._check_kwargs(renamed, error)

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {"crop_to_patches": True, **kwargs}

    def max_tokens_per_item(self) -> int:
        options = self._options(self.default_kwargs)
        most = int(options.get("max_patches", self.image_processor.max_patches))
        tiles = most + 1 if options["crop_to_patches"] and most > 1 else 1  # + the thumbnail
        return tiles * self.tokens_per_tile

    def process(self, token_ids: list[int], mm_data: dict[str, Any],
                request_kwargs: dict[str, Any] | None = None) -> MultiModalInputs:
        images = self._items(mm_data)
        kwargs = {**self.default_kwargs, **self._check_kwargs(request_kwargs or {}, InvalidRequestError)}
        processed = [self._tiles(image, kwargs) for image in images]
        lengths = [len(pixels) * self.tokens_per_tile for _, pixels in processed]
        ids = np.asarray(token_ids, dtype=np.int64)
        positions = np.flatnonzero(ids == self.image_token_id)
        # One bare placeholder per image (an expanded run sits between <img> and </img>).
        bare = len(positions) == len(processed) and all(
            (p == 0 or ids[p - 1] != self.start_id) and (p + 1 == len(ids) or ids[p + 1] != self.image_token_id)
            for p in positions.tolist())
        if bare:
            out_ids, starts, cursor = [], [], 0
            for pos, n in zip(positions.tolist(), lengths):
                out_ids.extend(token_ids[cursor:pos])
                out_ids.append(self.start_id)
                starts.append(len(out_ids))
                out_ids.extend([self.image_token_id] * n)
                out_ids.append(self.end_id)
                cursor = pos + 1
            out_ids.extend(token_ids[cursor:])
        else:
            starts, out_ids = self._expanded_runs(positions, lengths), list(token_ids)
        items = [MultiModalItem("image", ident, off, n, pixels, (len(pixels), 1, 1))
                 for (ident, pixels), off, n in zip(processed, starts, lengths)]
        return MultiModalInputs(out_ids, items)

    def _tiles(self, image: Any, kwargs: dict[str, Any]) -> tuple[str, Any]:
        """The image's identifier and its tiles ``[tiles, 3, S, S]`` (thumbnail last)."""
        identifier = hash_item("image", image, kwargs)
        hit = self.cache.get(identifier)
        if hit is not None:
            return identifier, hit[0]
        out = self.image_processor(images=[image], return_tensors="pt", **self._options(kwargs))
        pixel_values = out["pixel_values"]
        self.cache.put(identifier, pixel_values, (int(pixel_values.shape[0]), 1, 1))
        return identifier, pixel_values


CONTEXT_TOKEN = "<IMG_CONTEXT>"
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


class InternVLChatMultiModalProcessor(InternVLMultiModalProcessor):
    """Processes one request's images for ``InternVLChatModel``, tiled as its
    ``dynamic_preprocess`` tiles them (see the module docstring)."""

    # InternVL2's chat code writes "<image>\n" before the question; its template knows no images.
    placeholders = {"image": "<image>"}

    def _load_image_processor(self, folder: Path, hf_config: Any, backend: dict[str, str]) -> Any:
        from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

        tile = hf_config.vision_config.image_size  # [S, S] (remote_configs writes a square tile)
        size = int(tile[0] if isinstance(tile, (list, tuple)) else tile)
        return GotOcr2ImageProcessorPil(
            size={"height": size, "width": size}, image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD,
            crop_to_patches=bool(hf_config.dynamic_image_size), min_patches=int(hf_config.min_dynamic_patch),
            max_patches=int(hf_config.max_dynamic_patch))

    def __init__(self, folder: Path, hf_config: Any, *args: Any, **kwargs: Any):
        super().__init__(folder, hf_config, *args, **kwargs)
        self.use_thumbnail = bool(hf_config.use_thumbnail)

    def _start_end_ids(self, folder: Path) -> tuple[int, int]:
        from ferrollm.config.remote_configs import added_token_id

        ids = added_token_id(folder, "<img>"), added_token_id(folder, "</img>")
        if None in ids:
            raise ConfigError(f"InternVLChatModel's tokenizer in {folder} must have the added tokens '<img>' and "
                              f"'</img>'. Given: ids {ids}")
        return ids  # type: ignore[return-value]

    def prompt_text(self, prompt: str) -> str:
        return prompt.replace("<image>", CONTEXT_TOKEN)

    def _options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return {"crop_to_patches": self.image_processor.crop_to_patches, **kwargs}

    def max_tokens_per_item(self) -> int:
        most = super().max_tokens_per_item()
        options = self._options(self.default_kwargs)
        has_thumbnail = options["crop_to_patches"] and int(options.get("max_patches",
                                                                        self.image_processor.max_patches)) > 1
        return most - self.tokens_per_tile if has_thumbnail and not self.use_thumbnail else most

    def _tiles(self, image: Any, kwargs: dict[str, Any]) -> tuple[str, Any]:
        identifier, pixels = super()._tiles(image, kwargs)
        # GotOcr2 always adds the thumbnail to several tiles; dynamic_preprocess only with use_thumbnail.
        return identifier, pixels if self.use_thumbnail or len(pixels) == 1 else pixels[:-1]


def _start_end_ids(folder: Path) -> tuple[int, int]:
    """The ids of ``<img>`` and ``</img>`` in the checkpoint's tokenizer."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    start = getattr(tok, "start_image_token", None) or "<img>"
    end = getattr(tok, "end_image_token", None) or "</img>"
    return int(tok.convert_tokens_to_ids(start)), int(tok.convert_tokens_to_ids(end))
