"""Turns a prompt and its ``multi_modal_data`` into token ids with expanded placeholders and
processed items, through the checkpoint's own image processor (``preprocessor_config.json``).

For Qwen2-VL/Qwen2.5-VL a prompt holds one ``<|image_pad|>`` per image (inside
``<|vision_start|>...<|vision_end|>``); it is expanded to the image's ``t * h * w / merge**2``
tokens, as transformers' processor does. A prompt whose placeholders are already expanded is
accepted too. Options: `limit_mm_per_prompt` (items per modality) and `mm_processor_kwargs`
(the LLM's, overridden per request), checked against the keys the image processor accepts.

A model's processor class says which modalities it takes (`modalities`; images here, images and
videos in ``qwen2_vl_processor``); ``multi_modal_data`` with any other is refused by name.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ferrollm.exceptions import ConfigError, InvalidRequestError
from ferrollm.multimodal.cache import MultiModalInputCache, hash_item
from ferrollm.multimodal.inputs import MultiModalInputs, MultiModalItem

__all__ = ["DEFAULT_LIMIT", "MultiModalProcessor", "check_limits"]

# vLLM's default number of items per modality and prompt.
DEFAULT_LIMIT = 999
SUPPORTED_MODALITIES = ("image",)
# Call options of the image processor that are not processing options.
_NOT_OPTIONS = {"return_tensors", "device", "data_format", "input_data_format"}


def check_limits(limits: dict[str, int] | None, modalities: tuple[str, ...] = SUPPORTED_MODALITIES) -> dict[str, int]:
    """`limit_mm_per_prompt` with each of the model's ``modalities`` filled in.

    Raises:
        ConfigError: an unknown modality or a negative limit.
    """
    out = dict.fromkeys(modalities, DEFAULT_LIMIT)
    for modality, limit in (limits or {}).items():
        if modality not in ("image", "video", "audio"):
            raise ConfigError(f"`limit_mm_per_prompt` keys must be 'image', 'video' or 'audio'. Given: {modality!r}")
        value = limit.get("count", DEFAULT_LIMIT) if isinstance(limit, dict) else limit
        if not isinstance(value, int) or value < 0:
            raise ConfigError(f"`limit_mm_per_prompt[{modality!r}]` must be an int >= 0. Given: {limit!r}")
        out[modality] = value
    return out


class MultiModalProcessor:
    """Processes one request's multimodal data.

    Args:
        folder: the checkpoint folder (its ``preprocessor_config.json``).
        hf_config: the model's config (``image_token_id``, the vision config's merge size).
        limits: from :func:`check_limits`.
        default_kwargs: the LLM's `mm_processor_kwargs`.
        cache: the processed-input cache.
    """

    # transformers 5's image-processor backend a subclass needs ("pil" or "torchvision").
    image_processor_backend = "pil"

    # What `multi_modal_data` may hold for this model; a subclass that takes more widens it.
    modalities: tuple[str, ...] = SUPPORTED_MODALITIES
    # The text a prompt holds per item, by modality: what `LLM.chat` writes for an image part
    # when the chat template takes content as a string (`content_format.join_parts`).
    placeholders: dict[str, str] = {"image": "<|vision_start|><|image_pad|><|vision_end|>"}

    def __init__(self, folder: Path, hf_config: Any, limits: dict[str, int], default_kwargs: dict[str, Any] | None,
                 cache: MultiModalInputCache):
        import transformers

        # transformers 5 picks a torchvision backend when installed and warns when not: ask for
        # one (by default PIL, what the tests compare with) so the output does not depend on that.
        backend = {"backend": self.image_processor_backend} if int(transformers.__version__.split(".")[0]) >= 5 else {}
        self.image_processor = self._load_image_processor(folder, hf_config, backend)
        self.image_token_id = int(hf_config.image_token_id)
        # Fuyu has no vision config (and no merge).
        self.merge = int(getattr(getattr(hf_config, "vision_config", None), "spatial_merge_size", 1))
        self.limits = limits
        self.cache = cache
        annotations = getattr(getattr(self.image_processor, "valid_kwargs", None), "__annotations__", {})
        self.accepted_kwargs = sorted(set(annotations) - _NOT_OPTIONS)
        self.default_kwargs = self._check_kwargs(default_kwargs or {}, ConfigError)

    def _load_image_processor(self, folder: Path, hf_config: Any, backend: dict[str, str]) -> Any:
        """The checkpoint's image processor (``preprocessor_config.json``); a model whose tiling
        is not in one builds it from its config instead."""
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(str(folder), **backend)

    def prompt_text(self, prompt: str) -> str:
        """A text prompt with images as it is tokenized; a model whose placeholder is plain text
        (InternVL2's ``<image>``) rewrites it to its placeholder token here."""
        return prompt

    def max_tokens_per_item(self) -> int:
        """Placeholder tokens of the largest image the LLM-level options allow (an image is
        resized to at most ``max_pixels``, one token per merged ``(patch * merge)**2`` pixels)."""
        size = self._call_kwargs(self.default_kwargs).get("size") or self.image_processor.size
        size = dict(size)
        patch = int(self.default_kwargs.get("patch_size") or self.image_processor.patch_size)
        return int(size.get("longest_edge") or size.get("max_pixels") or 0) // (patch * self.merge) ** 2

    def _check_kwargs(self, kwargs: dict[str, Any], error: type[Exception]) -> dict[str, Any]:
        unknown = sorted(set(kwargs) - set(self.accepted_kwargs))
        if unknown:
            raise error(f"`mm_processor_kwargs` keys must be ones {type(self.image_processor).__name__} accepts: "
                        f"{self.accepted_kwargs}. Given: {unknown}")
        return dict(kwargs)

    def process(self, token_ids: list[int], mm_data: dict[str, Any],
                request_kwargs: dict[str, Any] | None = None) -> MultiModalInputs:
        """Expands the placeholders of ``token_ids`` for the images of ``mm_data``.

        Raises:
            InvalidRequestError: an unsupported modality, more items than `limit_mm_per_prompt`
                allows, unknown `mm_processor_kwargs`, or placeholders that do not match the items.
        """
        images = self._items(mm_data)
        kwargs = {**self.default_kwargs, **self._check_kwargs(request_kwargs or {}, InvalidRequestError)}
        processed = [self._process_image(image, kwargs) for image in images]
        return self._expand(token_ids, processed)

    def _items(self, mm_data: dict[str, Any]) -> list[Any]:
        """The prompt's images, after checking its modalities and the image limit."""
        self._check_modalities(mm_data)
        images = mm_data.get("image", [])
        return self._within_limit("image", list(images) if isinstance(images, (list, tuple)) else [images])

    def _check_modalities(self, mm_data: dict[str, Any]) -> None:
        for modality in mm_data:
            if modality not in self.modalities:
                raise InvalidRequestError(f"`multi_modal_data` keys must be one of {list(self.modalities)} (the "
                                          f"modalities this model takes in ferrollm). Given: {modality!r}")

    def _within_limit(self, modality: str, items: list[Any]) -> list[Any]:
        limit = self.limits[modality]
        if len(items) > limit:
            raise InvalidRequestError(f"At most {limit} {modality}(s) may be provided in one prompt "
                                      f"(limit_mm_per_prompt[{modality!r}]={limit}). Given: {len(items)}")
        return items

    def _process_image(self, image: Any, kwargs: dict[str, Any]) -> tuple[str, Any, tuple[int, int, int]]:
        identifier = hash_item("image", image, kwargs)
        hit = self.cache.get(identifier)
        if hit is not None:
            return identifier, hit[0], hit[1]
        out = self.image_processor(images=[image], return_tensors="pt", **self._call_kwargs(kwargs))
        pixel_values = out["pixel_values"]
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        self.cache.put(identifier, pixel_values, grid)  # type: ignore[arg-type]
        return identifier, pixel_values, grid  # type: ignore[return-value]

    def _call_kwargs(self, kwargs: dict[str, Any], processor: Any = None) -> dict[str, Any]:
        """vLLM's `min_pixels`/`max_pixels` as the ``size`` bounds transformers now reads (the
        bare keys are deprecated there); the other keys as given. ``processor`` (default: the
        image processor) supplies the ``size`` they amend."""
        kwargs = dict(kwargs)
        if "min_pixels" in kwargs or "max_pixels" in kwargs:
            size = dict(kwargs.pop("size", None) or (processor or self.image_processor).size)
            size = {k: v for k, v in size.items() if v is not None}
            if "min_pixels" in kwargs:
                size["shortest_edge"] = kwargs.pop("min_pixels")
            if "max_pixels" in kwargs:
                size["longest_edge"] = kwargs.pop("max_pixels")
            kwargs["size"] = size
        return kwargs

    def _expand(self, token_ids: list[int], processed: Sequence[tuple[str, Any, tuple[int, int, int]]]) -> MultiModalInputs:
        lengths = [t * h * w // self.merge**2 for _, _, (t, h, w) in processed]
        ids = np.asarray(token_ids, dtype=np.int64)
        positions = np.flatnonzero(ids == self.image_token_id)
        if len(positions) == len(processed):
            starts = positions.tolist()
            pieces, cursor, out_ids = [], 0, []
            for start, n in zip(starts, lengths):
                out_ids.extend(token_ids[cursor:start])
                pieces.append(len(out_ids))
                out_ids.extend([self.image_token_id] * n)
                cursor = start + 1
            out_ids.extend(token_ids[cursor:])
        else:
            pieces = self._expanded_runs(positions, lengths)
            out_ids = list(token_ids)
        items = [MultiModalItem("image", ident, off, n, pv, grid)
                 for (ident, pv, grid), off, n in zip(processed, pieces, lengths)]
        return MultiModalInputs(out_ids, items)

    def _expanded_runs(self, positions: np.ndarray, lengths: list[int], modality: str = "image",
                       token_id: int | None = None) -> list[int]:
        """The starts of already expanded placeholder runs, when they match the items exactly."""
        runs = np.split(positions, np.flatnonzero(np.diff(positions) != 1) + 1) if len(positions) else []
        if [len(r) for r in runs] == lengths:
            return [int(r[0]) for r in runs]
        token_id = self.image_token_id if token_id is None else token_id
        raise InvalidRequestError(
            f"the prompt has {len(positions)} {modality} placeholder token(s) (id {token_id}) in "
            f"{len(runs)} run(s), but `multi_modal_data` has {len(lengths)} {modality}(s): each {modality} needs "
            f"one placeholder (or a run of exactly its {lengths} expanded tokens)")
