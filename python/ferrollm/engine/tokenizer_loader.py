"""Tokenizers for one model: the HF tokenizer (chat templates, `get_tokenizer()`) and the Rust
core's tokenizer (batch encoding, incremental detokenization), loaded from the same files.

Where the core reads the folder's `tokenizer.json` itself, the HF tokenizer is loaded on first
use: generating from prompts never needs it, and loading it (with the transformers modules it
imports and a Python parse of tokenizer.json) took 1.18 s of a 10.4 s constructor in a profile on
the 2-core development machine, against 0.13 s now. A GGUF model's tokenizer files are converted
by transformers once and cached (`gguf_tokenizer`); after that it loads like a folder's.

`tokenizer_mode="slow"` loads the transformers tokenizer with ``use_fast=False`` and encodes text
prompts with it in Python; the core's tokenizer still detokenizes (with transformers 5 most
models have no separate slow tokenizer, and both are the same). `skip_tokenizer_init=True` loads
none: prompts must be token ids, outputs carry no text.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrollm._core import Tokenizer
from ferrollm.config.model_source import ModelSource
from ferrollm.engine.gguf_tokenizer import gguf_tokenizer_files
from ferrollm.exceptions import ConfigError, TokenizerError

# vLLM 0.32's modes for HF tokenizers ("auto" and "hf" are the same here), and vLLM's older "slow".
TOKENIZER_MODES = ("auto", "hf", "slow")
SKIPPED = "Tokenizer not available when `skip_tokenizer_init=True`"


class Tokenizers:
    """The model's two tokenizers.

    Args:
        core: the Rust tokenizer the engine core uses; None with `skip_tokenizer_init`.
        hf: the transformers tokenizer, or None with `load_hf`.
        load_hf: loads the transformers tokenizer on first use of `hf`.
        workdir: a temporary folder holding a materialized tokenizer.json, removed on close.
        encode_in_python: text prompts are encoded by `hf` (tokenizer_mode="slow"), not the core.
    """

    def __init__(self, core: Tokenizer | None, hf: Any = None, *, load_hf: Callable[[], Any] | None = None,
                 workdir: tempfile.TemporaryDirectory | None = None, encode_in_python: bool = False):
        self.core = core
        self._hf = hf
        self._load_hf = load_hf
        self.workdir = workdir
        self.encode_in_python = encode_in_python

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokenizer's EOS ids; none without a tokenizer (as vLLM, which warns)."""
        return [] if self.core is None else self.core.eos_token_ids

    def require_core(self) -> Tokenizer:
        """The core's tokenizer.

        Raises:
            TokenizerError: with vLLM's wording, when the engine was built without one.
        """
        if self.core is None:
            raise TokenizerError(SKIPPED)
        return self.core

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids of each text, from the tokenizer the mode chose."""
        if self.encode_in_python:
            return [list(ids) for ids in self.hf(texts, add_special_tokens=add_special_tokens)["input_ids"]]
        return self.require_core().encode_batch(texts, add_special_tokens)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer.

        Raises:
            TokenizerError: if it cannot be loaded.
        """
        if self._load_hf is not None:
            self._hf, self._load_hf = self._load_hf(), None
        if self._hf is None and self.core is None:
            raise TokenizerError(SKIPPED)
        return self._hf

    def close(self) -> None:
        if self.workdir is not None:
            self.workdir.cleanup()
            self.workdir = None


def load_tokenizers(source: ModelSource, tokenizer: str | None, revision: str | None = None,
                    mode: str = "auto") -> Tokenizers:
    """Loads both tokenizers. A GGUF model's tokenizer comes from the GGUF file unless
    `tokenizer` names another; a folder with `tokenizer.json` is read by the core directly (which
    drops any padding or truncation it asks for) and by transformers on first use; any other
    tokenizer is converted by transformers and written out once for the core.

    Raises:
        ConfigError: a `mode` other than TOKENIZER_MODES.
    """
    if mode not in TOKENIZER_MODES:
        raise ConfigError(f"`tokenizer_mode` must be one of {list(TOKENIZER_MODES)} (ferrollm loads Hugging Face "
                          f"tokenizers only). Given: {mode!r}")
    tokenizers = _load(source, tokenizer, revision)
    if mode == "slow":
        where = Path(tokenizer) if tokenizer else source.folder
        if tokenizer is None and source.gguf_file is not None:
            raise ConfigError("`tokenizer_mode='slow'` needs a tokenizer folder: pass `tokenizer=` with a GGUF model")
        tokenizers._hf, tokenizers._load_hf = None, lambda: _load_hf(where, revision, use_fast=False)
        tokenizers.encode_in_python = True
    return tokenizers


def _load(source: ModelSource, tokenizer: str | None, revision: str | None) -> Tokenizers:
    if tokenizer is None and source.gguf_file is not None:
        return _gguf_tokenizers(source.gguf_file)
    where = Path(tokenizer) if tokenizer else source.folder
    if (where / "tokenizer.json").is_file():
        return Tokenizers(Tokenizer(where), load_hf=lambda: _load_hf(where, revision))
    hf = _load_hf(where, revision)
    if not getattr(hf, "is_fast", False):
        raise TokenizerError(f"the tokenizer at {where} has no fast (tokenizers) version; ferrollm needs tokenizer.json")
    return _written_out(hf)


def _gguf_tokenizers(gguf_file: Path) -> Tokenizers:
    folder, hf = gguf_tokenizer_files(gguf_file)
    if folder is None:
        return _written_out(hf)
    core = Tokenizer(folder)
    if hf is not None:
        return Tokenizers(core, hf)
    return Tokenizers(core, load_hf=lambda: _load_hf(folder, None))


def _written_out(hf: Any) -> Tokenizers:
    """Both tokenizers from a transformers tokenizer, saved to a temporary folder for the core."""
    workdir = tempfile.TemporaryDirectory(prefix="ferrollm-tok-")
    hf.save_pretrained(workdir.name)
    return Tokenizers(Tokenizer(workdir.name), hf, workdir=workdir)


def _load_hf(where: Path, revision: str | None, use_fast: bool = True) -> Any:
    from transformers import AutoTokenizer

    try:
        # ferrollm never runs a checkpoint's code; saying so keeps transformers from asking on stdin
        # for folders whose config.json names remote code (InternLM2, InternVLChatModel).
        return AutoTokenizer.from_pretrained(str(where), revision=revision, use_fast=use_fast, trust_remote_code=False)
    except Exception as e:  # transformers raises OSError, ValueError, ... for unusable files
        raise TokenizerError(f"could not load the tokenizer from {where}: {e}") from e
