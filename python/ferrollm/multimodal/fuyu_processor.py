"""Fuyu's multimodal processing, laid out as transformers' ``FuyuProcessor`` builds its prompt.

The checkpoint's ``FuyuImageProcessor`` shrinks an image to fit its ``size`` (never enlarges it)
and pads it; the unpadded part, rounded up to whole patches, is cut into ``patch_size`` patches,
row-major: ``rows * cols`` patches of ``patch_size**2 * channels`` values. The prompt becomes

    ([|SPEAKER|] * cols + [|NEWLINE|]) * rows + [<s>] + prompt tokens + [<0x04>]

(the image first, then BOS, the text without special tokens and the beginning-of-answer token
``<0x04>``, which is appended unless the prompt already ends with it). A prompt that already holds
the image's placeholder run is taken as it is. Fuyu takes one image per prompt (transformers'
processor builds one run per prompt, as vLLM's ``limit_mm_per_prompt`` for Fuyu says); a text-only
prompt is not processed at all, as ``FuyuProcessor`` leaves text without images alone.

The image processor runs with transformers' torchvision backend: the PIL variant's
``patchify_image`` fails on the tensors its own preprocessing returns (transformers 5.24:
``TypeError`` from ``transpose``). ``mm_processor_kwargs`` takes the image processor's keys
except ``patch_size``, which the checkpoint's ``vision_embed_tokens`` width fixes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ferrollm.exceptions import ConfigError, InvalidRequestError
from ferrollm.multimodal.cache import hash_item
from ferrollm.multimodal.inputs import MultiModalInputs, MultiModalItem
from ferrollm.multimodal.processor import DEFAULT_LIMIT, MultiModalProcessor

__all__ = ["FuyuMultiModalProcessor"]

NEWLINE, BOS, BEGIN_ANSWER = "|NEWLINE|", "<s>", "<0x04>"


class FuyuMultiModalProcessor(MultiModalProcessor):
    """Processes one request's image for ``FuyuForCausalLM`` (arguments as
    :class:`MultiModalProcessor`'s).

    Raises:
        ConfigError: `limit_mm_per_prompt['image']` above 1, ``patch_size`` in
            `mm_processor_kwargs`, or a tokenizer without ``|NEWLINE|`` or ``<s>``.
    """

    image_processor_backend = "torchvision"
    # Nothing in the text: the processor puts the image's run before the prompt itself.
    placeholders = {"image": ""}

    def __init__(self, folder: Path, hf_config: Any, limits: dict[str, int], default_kwargs: dict[str, Any] | None,
                 *args: Any, **kwargs: Any):
        super().__init__(folder, hf_config, _one_image(limits), default_kwargs, *args, **kwargs)
        self.newline_id, self.bos_id, self.begin_answer = _special_ids(folder)

    def _check_kwargs(self, kwargs: dict[str, Any], error: type[Exception]) -> dict[str, Any]:
        if "patch_size" in kwargs:
            raise error("`mm_processor_kwargs['patch_size']` cannot be set for Fuyu: the checkpoint's "
                        f"vision_embed_tokens fixes it. Given: {kwargs['patch_size']!r}")
        return super()._check_kwargs(kwargs, error)

    def max_tokens_per_item(self) -> int:
        """The run of the largest image the options allow: ``size`` in whole patches, a newline
        closing each row."""
        height, width = _hw(self.default_kwargs.get("size") or self.image_processor.size)
        patch_h, patch_w = _hw(self.image_processor.patch_size)
        return math.ceil(height / patch_h) * (math.ceil(width / patch_w) + 1)

    def process(self, token_ids: list[int], mm_data: dict[str, Any],
                request_kwargs: dict[str, Any] | None = None) -> MultiModalInputs:
        images = self._items(mm_data)
        if not images:
            return MultiModalInputs(list(token_ids))
        kwargs = {**self.default_kwargs, **self._check_kwargs(request_kwargs or {}, InvalidRequestError)}
        identifier, patches, grid = self._patches(images[0], kwargs)
        run = self._placeholder_run(grid)
        if self.image_token_id in token_ids:
            offset, out_ids = self._expanded_offset(token_ids, run), list(token_ids)
        else:
            offset, out_ids = 0, run + self._text_after_image(token_ids)
        return MultiModalInputs(out_ids, [MultiModalItem("image", identifier, offset, len(run), patches, grid)])

    def _patches(self, image: Any, kwargs: dict[str, Any]) -> tuple[str, Any, tuple[int, int, int]]:
        """The image's identifier, its patches ``[rows * cols, patch_dim]`` and ``(1, rows, cols)``."""
        identifier = hash_item("image", image, kwargs)
        hit = self.cache.get(identifier)
        if hit is not None:
            return identifier, hit[0], hit[1]
        out = self.image_processor(images=[image], return_tensors="pt", **kwargs)
        patch_h, patch_w = _hw(self.image_processor.patch_size)
        padded = out["images"][0]  # [1, channels, H, W], the image top-left, padding beyond
        # The unpadded part rounded up to whole patches, as FuyuProcessor crops it.
        height = min(padded.shape[-2], math.ceil(int(out["image_unpadded_heights"][0][0]) / patch_h) * patch_h)
        width = min(padded.shape[-1], math.ceil(int(out["image_unpadded_widths"][0][0]) / patch_w) * patch_w)
        patches = self.image_processor.patchify_image(padded[..., :height, :width])[0]
        grid = (1, height // patch_h, width // patch_w)
        self.cache.put(identifier, patches, grid)
        return identifier, patches, grid

    def _placeholder_run(self, grid: tuple[int, int, int]) -> list[int]:
        _, rows, cols = grid
        return ([self.image_token_id] * cols + [self.newline_id]) * rows

    def _text_after_image(self, token_ids: list[int]) -> list[int]:
        """``<s>``, the prompt's tokens (without the BOS the tokenizer may have put first) and
        the beginning-of-answer token."""
        text = list(token_ids[1:] if token_ids[:1] == [self.bos_id] else token_ids)
        if text[-len(self.begin_answer):] != self.begin_answer:
            text += self.begin_answer
        return [self.bos_id, *text]

    def _expanded_offset(self, token_ids: list[int], run: list[int]) -> int:
        """Where the prompt's own placeholder run starts, when it is exactly the image's."""
        start = token_ids.index(self.image_token_id)
        num_patches = run.count(self.image_token_id)
        if token_ids[start : start + len(run)] != run or token_ids.count(self.image_token_id) != num_patches:
            raise InvalidRequestError(
                f"the prompt has {token_ids.count(self.image_token_id)} image placeholder token(s) (id "
                f"{self.image_token_id}), but its image needs none (they are inserted) or exactly one run of "
                f"{len(run) // (run.index(self.newline_id) + 1)} rows of {run.index(self.newline_id)} "
                f"placeholders, each row closed by {NEWLINE} (id {self.newline_id})")
        return start


def _one_image(limits: dict[str, int]) -> dict[str, int]:
    """Fuyu's image limit: 1 by default, at most 1 when given."""
    image = limits.get("image", DEFAULT_LIMIT)
    if image != DEFAULT_LIMIT and image > 1:
        raise ConfigError("`limit_mm_per_prompt['image']` must be <= 1 for FuyuForCausalLM (one image per "
                          f"prompt, as transformers' FuyuProcessor builds it). Given: {image}")
    return {**limits, "image": min(image, 1)}


def _hw(size: Any) -> tuple[int, int]:
    """``(height, width)`` of a size dict or transformers' ``SizeDict``."""
    if isinstance(size, dict):
        return int(size["height"]), int(size["width"])
    return int(size.height), int(size.width)


def _special_ids(folder: Path) -> tuple[int, int, list[int]]:
    """``(|NEWLINE| id, <s> id, <0x04>'s ids)`` in the checkpoint's tokenizer: ``<0x04>`` is one
    token of Fuyu's vocabulary (taken by id, as vLLM does: encoding it alone could add the
    SentencePiece prefix), else what the tokenizer makes of the text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    vocab = tok.get_vocab()
    missing = [t for t in (NEWLINE, BOS) if t not in vocab]
    if missing:
        raise ConfigError(f"Fuyu's tokenizer must have the tokens {[NEWLINE, BOS]}; missing: {missing}")
    if BEGIN_ANSWER in vocab:
        return vocab[NEWLINE], vocab[BOS], [vocab[BEGIN_ANSWER]]
    return vocab[NEWLINE], vocab[BOS], list(tok.encode(BEGIN_ANSWER, add_special_tokens=False))
