"""Videos for the tiny Qwen2-VL / Qwen2.5-VL checkpoints of ``vl_checkpoints``: a video processor
config saved beside the image one (smaller frames than images, so a test sees which is read),
random frames, and transformers' own processor and greedy ``generate`` as the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from helpers.vl_checkpoints import image_processor

# At most 16 merged tokens per frame group keeps a 4-frame video at <= 32 placeholder tokens.
VIDEO_PROCESSOR = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)


def video_processor(**kwargs):
    from transformers import Qwen2VLVideoProcessor

    size = {"shortest_edge": kwargs.pop("min_pixels", VIDEO_PROCESSOR["min_pixels"]),
            "longest_edge": kwargs.pop("max_pixels", VIDEO_PROCESSOR["max_pixels"])}
    return Qwen2VLVideoProcessor(size=size, **kwargs)


def save_video_processor(folder: Path) -> None:
    """Writes ``video_preprocessor_config.json`` (what ``AutoVideoProcessor`` reads first)."""
    video_processor().save_pretrained(folder)


def random_video(seed: int, frames: int, height: int, width: int) -> np.ndarray:
    """uint8 ``[frames, height, width, 3]``."""
    return np.random.default_rng(seed).integers(0, 255, (frames, height, width, 3), dtype=np.uint8)


def hf_processor(folder: Path, model_type: str):
    """transformers' processor of the checkpoint, with the same image and video processors."""
    from transformers import AutoTokenizer, Qwen2_5_VLProcessor, Qwen2VLProcessor

    cls = Qwen2_5_VLProcessor if model_type == "qwen2_5_vl" else Qwen2VLProcessor
    return cls(image_processor=image_processor(), tokenizer=AutoTokenizer.from_pretrained(str(folder)),
               video_processor=video_processor())


def hf_greedy_mm(model, processor, prompt: str, images: list, videos: list, max_tokens: int,
                 **kwargs) -> tuple[list[int], list[int]]:
    """The prompt's expanded ids and transformers' greedy tokens, everything (placeholder
    expansion, ``second_per_grid_ts``, M-RoPE) done by transformers."""
    inputs = processor(text=[prompt], images=images or None, videos=videos or None, return_tensors="pt", **kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False)
    ids = inputs["input_ids"][0].tolist()
    return ids, out[0, len(ids):].tolist()
