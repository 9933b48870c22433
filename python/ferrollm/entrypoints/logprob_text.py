"""The `decoded_token` of each logprob entry, as vLLM's output processor writes it.

Each token is decoded on its own (special tokens kept). Two corrections follow vLLM:

- SentencePiece-style tokenizers (a `Metaspace` pre-tokenizer) lose a piece's leading space when
  one token is decoded alone; it is put back from the raw piece's `▁` markers (a Metaspace
  with another replacement character is not corrected).
- A token that is only part of a multi-byte UTF-8 character decodes to text ending in U+FFFD.
  It is decoded again after the 1..4 chosen tokens before it (the sampled tokens, or the prompt
  tokens from the second on), and gets the text that the completed character adds beyond the
  clean prefix of that context; a token that completes nothing gets "".

Single-token texts are cached per tokenizer; the context decodes only run for U+FFFD tokens.
"""

from __future__ import annotations

import json
from typing import Any

from ferrollm._core import Tokenizer

__all__ = ["LogprobTextDecoder"]

_REPLACEMENT = "\ufffd"
# A UTF-8 character spans at most 4 bytes, so 4 tokens of context complete any of them.
_MAX_CONTEXT = 4
# The default Metaspace replacement; a piece without it at its start needs no correction.
_METASPACE = "\u2581"


class LogprobTextDecoder:
    """Decodes logprob entries' tokens for one tokenizer.

    Args:
        tokenizer: The core's tokenizer (decoding and raw pieces).
        hf_tokenizer: A callable returning the transformers tokenizer, asked only when a raw
            piece starts with `▁`, to read its pre-tokenizer's marker.
    """

    def __init__(self, tokenizer: Tokenizer, hf_tokenizer: Any = None):
        self.tokenizer = tokenizer
        self._hf_tokenizer = hf_tokenizer
        self._marker: str | None | bool = False  # False: not read yet
        self._single: dict[int, str] = {}

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def single(self, token_id: int) -> str:
        """One token's text alone, its leading spaces restored for SentencePiece pieces."""
        text = self._single.get(token_id)
        if text is None:
            text = self.decode([token_id])
            raw = self.tokenizer.id_to_token(token_id) or ""
            # Only a piece starting with `▁` can have lost a space; the tokenizer is asked
            # whether `▁` is its marker then (byte-level vocabularies never spell it).
            if raw.startswith(_METASPACE):
                text = _restore_leading_spaces(raw, text, self.marker())
            self._single[token_id] = text
        return text

    def marker(self) -> str | None:
        """The Metaspace replacement of the tokenizer's pre-tokenizer, or None."""
        if self._marker is False:
            self._marker = _read_marker(self._hf_tokenizer() if self._hf_tokenizer else None)
        return self._marker  # type: ignore[return-value]

    def texts(self, token_ids: list[int], context: list[int]) -> list[str]:
        """The decoded tokens of one position's entries.

        Args:
            token_ids: The chosen token and the top k (alternatives at the same position).
            context: The chosen tokens before this position, oldest first.
        """
        out = [self.single(t) for t in token_ids]
        for i, text in enumerate(out):
            if text.endswith(_REPLACEMENT):
                out[i] = self._completed(token_ids[i], context[-_MAX_CONTEXT:])
        return out

    def _completed(self, token_id: int, context: list[int]) -> str:
        """What `token_id` adds after the shortest context that completes its character."""
        for n in range(1, len(context) + 1):
            ctx = context[-n:]
            full = self.decode(ctx + [token_id])
            if full.endswith(_REPLACEMENT):
                continue
            # Context tokens that were themselves partial characters showed as "", so the
            # character's text belongs to this token: only the clean prefix is taken away.
            clean_end = len(ctx)
            while clean_end > 0 and self.decode([ctx[clean_end - 1]]).endswith(_REPLACEMENT):
                clean_end -= 1
            prefix = self.decode(ctx[:clean_end]) if clean_end else ""
            if full.startswith(prefix):
                return full[len(prefix):]
            common = 0  # normalization changed the prefix: cut at the longest common prefix
            while common < min(len(prefix), len(full)) and prefix[common] == full[common]:
                common += 1
            return full[common:]
        return ""


def _restore_leading_spaces(raw: str, text: str, marker: str | None) -> str:
    if not marker:
        return text
    num_markers = len(raw) - len(raw.lstrip(marker))
    missing = num_markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


def _read_marker(hf_tokenizer: Any) -> str | None:
    """The `replacement` of a Metaspace pre-tokenizer (alone or in a Sequence), else None."""
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    except (ValueError, AttributeError):
        return None
    candidates = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for sub in candidates:
        if sub.get("type") == "Metaspace":
            return sub.get("replacement", _METASPACE)
    return None
