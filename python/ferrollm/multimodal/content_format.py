"""How a chat template takes a message's content, as vLLM's ``chat_template_content_format``.

- ``"openai"``: the template loops over content parts (``{% for part in message['content'] %}``)
  and renders each image part as the model's placeholder (Qwen2-VL's, Gemma 3's templates).
- ``"string"``: the template prints ``message['content']`` as text (InternLM2's, which
  InternVL2 ships). Each message's parts are then joined into one string, the model's
  placeholder for each image or video first, then the texts, one per line; as vLLM does, so the
  prompt carries one placeholder per item even though the template knows nothing of images.

``"auto"`` reads the template's syntax tree for such a loop.
"""

from __future__ import annotations

from typing import Any

from ferrollm.exceptions import InvalidRequestError
from ferrollm.multimodal.chat import map_list_contents

__all__ = ["CONTENT_FORMATS", "detect_content_format", "join_parts", "resolve_content_format"]

CONTENT_FORMATS = ("auto", "string", "openai")


def resolve_content_format(given: str, template: Any) -> str:
    """``given`` ("auto" resolved against ``template``, a Jinja string or None).

    Raises:
        InvalidRequestError: ``given`` is not one of `CONTENT_FORMATS`.
    """
    if given not in CONTENT_FORMATS:
        raise InvalidRequestError(f"`chat_template_content_format` must be one of {list(CONTENT_FORMATS)}. "
                                  f"Given: {given!r}")
    return detect_content_format(template) if given == "auto" else given


def detect_content_format(template: Any) -> str:
    """"openai" when ``template`` loops over a message's ``content`` (directly, or through a
    variable set from it), else "string". A template that is not a parsable string counts as
    "openai", the shape the messages already have."""
    import jinja2
    from jinja2 import nodes

    if not isinstance(template, str):
        return "openai"
    try:
        tree = jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return "openai"
    aliases = {a.target.name for a in tree.find_all(nodes.Assign)
               if isinstance(a.target, nodes.Name) and _is_content(a.node, set())}
    loops = tree.find_all(nodes.For)
    return "openai" if any(_is_content(loop.iter, aliases) for loop in loops) else "string"


def _is_content(node: Any, aliases: set[str]) -> bool:
    """Whether ``node`` is ``x['content']``, ``x.content`` or a name set from one of them."""
    from jinja2 import nodes

    if isinstance(node, nodes.Filter):  # `message['content'] | selectattr(...)` and the like
        return _is_content(node.node, aliases)
    if isinstance(node, nodes.Getattr):
        return node.attr == "content"
    if isinstance(node, nodes.Getitem):
        return isinstance(node.arg, nodes.Const) and node.arg.value == "content"
    return isinstance(node, nodes.Name) and node.name in aliases


def join_parts(conversation: list[dict[str, Any]], placeholders: dict[str, str]) -> list[dict[str, Any]]:
    """``conversation`` (its image and video parts already ``{"type": "image" | "video"}``) with
    each list content joined into a string for a "string" template.

    Raises:
        InvalidRequestError: a part of a modality the model has no placeholder for.
    """
    return map_list_contents(conversation, lambda parts: _joined(parts, placeholders))


def _joined(parts: list[Any], placeholders: dict[str, str]) -> str:
    marks, texts = [], []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text":
            texts.append(part.get("text", ""))
        elif kind in placeholders:
            marks.append(placeholders[kind])
        else:
            raise InvalidRequestError(f"message content parts must be text or one of {sorted(placeholders)} "
                                      f"for this model. Given: {kind!r}")
    # Fuyu's placeholder is empty: its processor lays the image out itself.
    return "\n".join([m for m in marks if m] + ["\n".join(texts)])
