"""Qwen2-VL's and Qwen2.5-VL's multimodal processing: images as :class:`MultiModalProcessor`
processes them, and videos through the checkpoint's video processor (``Qwen2VLVideoProcessor``,
which ``AutoVideoProcessor`` builds from ``video_preprocessor_config.json``, else from
``preprocessor_config.json``).

A video is a list of PIL images (or of ``[H, W, 3]`` arrays), a uint8 array ``[T, H, W, 3]``, or
either paired with its metadata as ``(frames, {"fps": ..., ...})`` (vLLM's form; the keys of
transformers' ``VideoMetadata``). ``multi_modal_data["video"]`` holds one video or a list of them,
beside ``"image"`` or alone. Each ``<|video_pad|>`` of a prompt is expanded to the video's
``t * h * w / merge**2`` tokens, as transformers' processor does (``t``: frames grouped by the
temporal patch size, the last frame repeated to fill a group); runs already expanded are
accepted. Images and videos are matched to their own placeholders in prompt order.

``mm_processor_kwargs``: keys the image processor or the video processor accepts; each gets the
ones it accepts, as transformers' processor splits a call's options (``max_pixels`` reaches both;
``fps``, ``num_frames`` and ``do_sample_frames`` only videos). A video's ``second_per_grid_t``
(temporal patch size / its sampled fps; transformers assumes 24 fps for a video without
metadata) spaces Qwen2.5-VL's temporal M-RoPE positions.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from ferrollm.exceptions import InvalidRequestError
from ferrollm.multimodal.cache import MultiModalInputCache, hash_item
from ferrollm.multimodal.inputs import MultiModalInputs, MultiModalItem
from ferrollm.multimodal.processor import _NOT_OPTIONS, MultiModalProcessor

__all__ = ["Qwen2VLMultiModalProcessor"]

# Video processor call options that ferrollm sets itself.
_VIDEO_INTERNAL = {"return_metadata", "video_metadata"}
_VIDEO_FORMS = ("a list of PIL images or [H, W, 3] arrays, a uint8 array [T, H, W, 3], or either as "
                "(frames, metadata dict)")


class Qwen2VLMultiModalProcessor(MultiModalProcessor):
    """Processes one request's images and videos for Qwen2-VL and Qwen2.5-VL (arguments as
    :class:`MultiModalProcessor`'s)."""

    modalities = ("image", "video")
    placeholders = {"image": "<|vision_start|><|image_pad|><|vision_end|>",
                    "video": "<|vision_start|><|video_pad|><|vision_end|>"}

    def __init__(self, folder: Path, hf_config: Any, limits: dict[str, int], default_kwargs: dict[str, Any] | None,
                 cache: MultiModalInputCache):
        from transformers import AutoVideoProcessor

        # Before the base class checks `default_kwargs`, which may hold video keys.
        self.video_processor = AutoVideoProcessor.from_pretrained(str(folder))
        self.video_token_id = int(hf_config.video_token_id)
        annotations = getattr(self.video_processor.valid_kwargs, "__annotations__", {})
        self.video_kwargs = sorted(set(annotations) - _NOT_OPTIONS - _VIDEO_INTERNAL)
        super().__init__(folder, hf_config, limits, default_kwargs, cache)

    def _check_kwargs(self, kwargs: dict[str, Any], error: type[Exception]) -> dict[str, Any]:
        accepted = sorted(set(self.accepted_kwargs) | set(self.video_kwargs))
        unknown = sorted(set(kwargs) - set(accepted))
        if unknown:
            raise error(f"`mm_processor_kwargs` keys must be ones {type(self.image_processor).__name__} or "
                        f"{type(self.video_processor).__name__} accepts: {accepted}. Given: {unknown}")
        return dict(kwargs)

    def max_tokens_per_item(self) -> int:
        """The largest item the limits allow: an image at the image size bound, or a video of
        ``max_frames`` frames at the video size bound (the engine caps it at `max_model_len`)."""
        image = super().max_tokens_per_item() if self.limits.get("image", 0) else 0
        video = self._max_video_tokens() if self.limits.get("video", 0) else 0
        return max(image, video)

    def _max_video_tokens(self) -> int:
        options = self._video_options(self.default_kwargs)
        vp = self.video_processor
        size = dict(options.get("size") or vp.size)
        patch = int(options.get("patch_size") or vp.patch_size)
        temporal = int(options.get("temporal_patch_size") or vp.temporal_patch_size)
        frames = int(options.get("max_frames") or vp.max_frames)
        per_group = int(size.get("longest_edge") or 0) // (patch * self.merge) ** 2
        return -(-frames // temporal) * per_group

    def process(self, token_ids: list[int], mm_data: dict[str, Any],
                request_kwargs: dict[str, Any] | None = None) -> MultiModalInputs:
        """Expands the placeholders of ``token_ids`` for the images and videos of ``mm_data``.

        Raises:
            InvalidRequestError: an unsupported modality, more items than `limit_mm_per_prompt`
                allows, unknown `mm_processor_kwargs`, a malformed video, or placeholders that do
                not match the items.
        """
        images = self._items(mm_data)
        videos = self._within_limit("video", _videos(mm_data["video"]) if "video" in mm_data else [])
        kwargs = {**self.default_kwargs, **self._check_kwargs(request_kwargs or {}, InvalidRequestError)}
        image_kwargs = {k: v for k, v in kwargs.items() if k in self.accepted_kwargs}
        video_kwargs = {k: v for k, v in kwargs.items() if k in self.video_kwargs}
        items = [MultiModalItem("image", ident, 0, 0, pixels, grid)
                 for ident, pixels, grid in (self._process_image(im, image_kwargs) for im in images)]
        items += [self._process_video(frames, meta, video_kwargs) for frames, meta in videos]
        return self._expand_items(token_ids, items)

    def _video_options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        return self._call_kwargs(kwargs, self.video_processor)

    def _process_video(self, frames: Any, meta: dict[str, Any] | None, kwargs: dict[str, Any]) -> MultiModalItem:
        """The video's item (offset and length filled in by `_expand_items`), from the cache
        when the same frames, metadata and options were processed before."""
        identifier = hash_item("video", [frames, meta or {}], kwargs)
        hit = self.cache.get_entry(identifier)
        if hit is not None:
            pixels, grid, extra = hit
            return MultiModalItem("video", identifier, 0, 0, pixels, grid, extra["second_per_grid_t"])
        call = self._video_options(kwargs)
        if meta is not None:
            call["video_metadata"] = [_metadata(meta, len(frames))]
        try:
            out = self.video_processor(videos=[frames], return_tensors="pt", return_metadata=True, **call)
        except (ValueError, TypeError) as e:  # e.g. fps sampling without metadata, too few frames
            raise InvalidRequestError(f"{type(self.video_processor).__name__} refused the video: {e}") from e
        pixels = out["pixel_values_videos"]
        t, h, w = (int(x) for x in out["video_grid_thw"][0].tolist())
        # As Qwen2.5-VL's processor: a temporal patch lasts temporal_patch_size / sampled fps seconds.
        second = self.video_processor.temporal_patch_size / out["video_metadata"][0].sampled_fps
        self.cache.put(identifier, pixels, (t, h, w), {"second_per_grid_t": second})
        return MultiModalItem("video", identifier, 0, 0, pixels, (t, h, w), second)

    def _expand_items(self, token_ids: list[int], items: list[MultiModalItem]) -> MultiModalInputs:
        """Each modality's items against its own placeholders: one bare placeholder per item
        is expanded, runs already expanded are taken as they are; items end in prompt order."""
        ids = np.asarray(token_ids, dtype=np.int64)
        edits: list[tuple[int, int, int, MultiModalItem]] = []  # (start, end, token id, item)
        for modality, token_id in (("image", self.image_token_id), ("video", self.video_token_id)):
            mine = [it for it in items if it.modality == modality]
            for it in mine:
                it.length = int(np.prod(it.grid)) // self.merge**2
            positions = np.flatnonzero(ids == token_id)
            if len(positions) == len(mine):
                edits += [(int(p), int(p) + 1, token_id, it) for p, it in zip(positions, mine)]
            else:
                starts = self._expanded_runs(positions, [it.length for it in mine], modality, token_id)
                edits += [(s, s + it.length, token_id, it) for s, it in zip(starts, mine)]
        out_ids: list[int] = []
        cursor = 0
        for start, end, token_id, it in sorted(edits, key=lambda e: e[0]):
            out_ids.extend(token_ids[cursor:start])
            it.offset = len(out_ids)
            out_ids.extend([token_id] * it.length)
            cursor = end
        out_ids.extend(token_ids[cursor:])
        return MultiModalInputs(out_ids, [e[3] for e in sorted(edits, key=lambda e: e[0])])


def _videos(value: Any) -> list[tuple[Any, dict[str, Any] | None]]:
    """``multi_modal_data["video"]`` as ``(frames, metadata or None)`` per video."""
    one = _as_video(value)
    if one is not None:
        return [one]
    if isinstance(value, (list, tuple)) and value:
        videos = [_as_video(v) for v in value]
        if all(v is not None for v in videos):
            return videos  # type: ignore[return-value]
    raise InvalidRequestError(f"`multi_modal_data['video']` must be a video ({_VIDEO_FORMS}) or a list of videos. "
                              f"Given: {_describe(value)}")


def _as_video(value: Any) -> tuple[Any, dict[str, Any] | None] | None:
    """``(frames, metadata)`` when ``value`` is one video, else None."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict) and _is_frames(value[0]):
        return value[0], value[1]
    return (value, None) if _is_frames(value) else None


def _is_frames(value: Any) -> bool:
    if hasattr(value, "ndim") and hasattr(value, "shape"):  # an array or tensor
        return value.ndim == 4 and value.shape[0] > 0
    return (isinstance(value, list) and len(value) > 0
            and all(hasattr(f, "mode") or (hasattr(f, "ndim") and f.ndim == 3) for f in value))


def _describe(value: Any) -> str:
    if hasattr(value, "shape"):
        return f"{type(value).__name__} of shape {tuple(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{type(value).__name__} of {len(value)} {sorted({type(v).__name__ for v in value})}"
    return type(value).__name__


def _metadata(meta: dict[str, Any], num_frames: int) -> Any:
    """transformers' ``VideoMetadata`` from vLLM's metadata dict (unknown keys dropped); the
    frame count defaults to the frames given."""
    from transformers.video_utils import VideoMetadata

    fields = {f.name for f in dataclasses.fields(VideoMetadata)}
    known = {k: v for k, v in meta.items() if k in fields}
    known.setdefault("total_num_frames", num_frames)
    return VideoMetadata(**known)
