"""Images in `LLM.chat` messages, as OpenAI-style content parts: ``{"type": "image_url",
"image_url": {"url": "data:image/png;base64,..." or a local path}}`` and ``{"type": "image_pil",
"image_pil": <PIL image>}``. Each becomes a ``{"type": "image"}`` part for the chat template
(which renders the model's placeholder) and an item of the prompt's ``multi_modal_data``.

``video_url`` parts are refused: vLLM decodes video files with OpenCV or PyAV, which ferrollm
does not bundle. Videos go through `LLM.generate` as decoded frames instead
(``multi_modal_data={"video": frames}``).
"""

from __future__ import annotations

import base64
import io
from pathlib import Path
from typing import Any

from ferrollm.exceptions import InvalidRequestError

__all__ = ["extract_images", "load_image_url", "map_list_contents", "processor_chat_template"]


def processor_chat_template(folder: Path | None) -> str | None:
    """The template multimodal checkpoints keep beside their processor (``chat_template.json``
    or ``chat_template.jinja``) when the tokenizer has none; None if there is neither."""
    if folder is None:
        return None
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    if (folder / "chat_template.json").is_file():
        import json

        template = json.loads((folder / "chat_template.json").read_text()).get("chat_template")
        return template if isinstance(template, str) else None
    return None


def load_image_url(url: str) -> Any:
    """A PIL image from a ``data:`` URL, a ``file://`` URL or a local path.

    Raises:
        InvalidRequestError: a remote URL (not fetched) or an unreadable image.
    """
    from PIL import Image

    try:
        if url.startswith("data:"):
            _, _, payload = url.partition(",")
            return Image.open(io.BytesIO(base64.b64decode(payload))).convert("RGB")
        if url.startswith(("http://", "https://")):
            raise InvalidRequestError("`image_url` must be a data: URL or a local file path (remote images are not "
                                      f"fetched). Given: {url[:80]!r}")
        return Image.open(Path(url.removeprefix("file://"))).convert("RGB")
    except InvalidRequestError:
        raise
    except Exception as e:  # an unreadable file or undecodable data
        raise InvalidRequestError(f"`image_url` could not be read as an image ({e}). Given: {url[:80]!r}") from e


def map_list_contents(conversation: list[dict[str, Any]], fn) -> list[dict[str, Any]]:
    """The conversation with each list content (OpenAI-style parts) replaced by ``fn(parts)``;
    string contents as they are."""
    return [{**m, "content": fn(m["content"])} if isinstance(m.get("content"), list) else m for m in conversation]


def extract_images(conversation: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """The conversation with image parts replaced by ``{"type": "image"}``, and the images in
    order."""
    images: list[Any] = []
    out = map_list_contents(conversation, lambda parts: [_image_part(part, images) for part in parts])
    return out, images


def _image_part(part: Any, images: list[Any]) -> Any:
    """``part`` as the template sees it; an image part's image appended to ``images``."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "image_url":
        ref = part["image_url"]
        images.append(load_image_url(ref["url"] if isinstance(ref, dict) else ref))
        return {"type": "image"}
    if kind == "image_pil":
        images.append(part["image_pil"])
        return {"type": "image"}
    if kind == "video_url":
        raise InvalidRequestError(
            "`video_url` content parts are not supported: ferrollm has no video decoder. Decode the frames "
            "and pass them to `LLM.generate` as multi_modal_data={'video': frames} (a list of PIL images "
            "or a uint8 array [T, H, W, 3]) with the model's video placeholder in the prompt")
    return part
