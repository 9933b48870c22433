"""Gemma 3's multimodal processing: each ``<start_of_image>`` of a prompt becomes, as
transformers' ``Gemma3Processor`` writes it, ``"\\n\\n<start_of_image>" + "<image_soft_token>" *
mm_tokens_per_image + "<end_of_image>\\n\\n"``, tokenized with the checkpoint's tokenizer (the
way vLLM expands it, so a BPE merge across the boundary with the prompt's own text can differ
from tokenizing the whole expanded text). A prompt whose soft tokens are already expanded (one
run per image, e.g. from ``Gemma3Processor``) is taken as it is.

Pan-and-scan (``mm_processor_kwargs={"do_pan_and_scan": True}``) crops a wide or tall image;
the original and each crop become their own item and soft-token run, with transformers' text
around them. Every item is ``[1, 3, image_size, image_size]`` pixels and ``mm_tokens_per_image``
placeholder tokens; an image with its crops is one entry of the input cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ferrollm.exceptions import InvalidRequestError
from ferrollm.multimodal.cache import hash_item
from ferrollm.multimodal.inputs import MultiModalInputs, MultiModalItem
from ferrollm.multimodal.processor import MultiModalProcessor

__all__ = ["Gemma3MultiModalProcessor"]

_CROPS_INTRO = "Here is the original image {} and here are some crops to help you see better "


class Gemma3MultiModalProcessor(MultiModalProcessor):
    """Processes one request's images for ``Gemma3ForConditionalGeneration`` (arguments as
    :class:`MultiModalProcessor`'s)."""

    placeholders = {"image": "<start_of_image>"}

    def __init__(self, folder: Path, hf_config: Any, *args: Any, **kwargs: Any):
        super().__init__(folder, hf_config, *args, **kwargs)
        self.tokens_per_image = int(hf_config.mm_tokens_per_image)
        self.boi_token_id = int(hf_config.boi_token_id)
        self.encode, token = _tokenizer(folder)
        soft = token(self.image_token_id) * self.tokens_per_image
        self.full_image = f"\n\n{token(self.boi_token_id)}{soft}{token(int(hf_config.eoi_token_id))}\n\n"

    def max_tokens_per_item(self) -> int:
        return self.tokens_per_image

    def process(self, token_ids: list[int], mm_data: dict[str, Any],
                request_kwargs: dict[str, Any] | None = None) -> MultiModalInputs:
        images = self._items(mm_data)
        kwargs = {**self.default_kwargs, **self._check_kwargs(request_kwargs or {}, InvalidRequestError)}
        processed = [self._process_gemma3_image(image, kwargs) for image in images]
        return self._expand_gemma3(token_ids, processed)

    def _process_gemma3_image(self, image: Any, kwargs: dict[str, Any]) -> tuple[str, Any]:
        """The image's identifier and its pixels ``[1 + crops, 3, H, W]``."""
        identifier = hash_item("image", image, kwargs)
        hit = self.cache.get(identifier)
        if hit is not None:
            return identifier, hit[0]
        out = self.image_processor(images=[image], return_tensors="pt", **{**_processor_defaults(), **kwargs})
        pixel_values = out["pixel_values"]
        self.cache.put(identifier, pixel_values, (int(pixel_values.shape[0]), 1, 1))
        return identifier, pixel_values

    def _expand_gemma3(self, token_ids: list[int], processed: Sequence[tuple[str, Any]]) -> MultiModalInputs:
        ids = np.asarray(token_ids, dtype=np.int64)
        soft = np.flatnonzero(ids == self.image_token_id)
        boi = np.flatnonzero(ids == self.boi_token_id)
        if len(soft) == 0 and len(boi) == len(processed):
            out_ids, cursor = [], 0
            for start, (_, pixels) in zip(boi.tolist(), processed):
                out_ids.extend(token_ids[cursor:start])
                out_ids.extend(self.encode(self._replacement(pixels.shape[0] - 1)))
                cursor = start + 1
            out_ids.extend(token_ids[cursor:])
        elif len(soft) == 0:
            raise InvalidRequestError(
                f"the prompt has {len(boi)} <start_of_image> token(s) (id {self.boi_token_id}), but "
                f"`multi_modal_data` has {len(processed)} image(s): each image needs one")
        else:
            out_ids = list(token_ids)
        # The original image and each crop are their own item (and soft-token run).
        pieces = [(ident if len(pixels) == 1 else f"{ident}:{k}", pixels[k : k + 1])
                  for ident, pixels in processed for k in range(len(pixels))]
        runs = np.flatnonzero(np.asarray(out_ids) == self.image_token_id)
        starts = self._expanded_runs(runs, [self.tokens_per_image] * len(pieces))
        items = [MultiModalItem("image", ident, off, self.tokens_per_image, piece, (1, 1, 1))
                 for (ident, piece), off in zip(pieces, starts)]
        return MultiModalInputs(out_ids, items)

    def _replacement(self, num_crops: int) -> str:
        if num_crops == 0:
            return self.full_image
        return _CROPS_INTRO.format(self.full_image) + " ".join([self.full_image] * num_crops)


def _processor_defaults() -> dict[str, Any]:
    """The image options ``Gemma3Processor`` passes by default (pan-and-scan's crop sizes: the
    image processor alone leaves them unset)."""
    from transformers import Gemma3Processor

    return dict(getattr(Gemma3Processor, "images_kwargs", {}))


def _tokenizer(folder: Path):
    """``(encode(text) -> ids without special tokens added, id -> token string)``."""
    path = Path(folder) / "tokenizer.json"
    if path.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return (lambda text: tok.encode(text, add_special_tokens=False).ids), tok.id_to_token
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(folder))
    return (lambda text: hf.encode(text, add_special_tokens=False)), hf.convert_ids_to_tokens
