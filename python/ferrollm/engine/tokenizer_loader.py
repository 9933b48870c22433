"""Tokenizers for one model: the HF tokenizer (chat templates, `get_tokenizer()`) and the Rust
core's tokenizer (batch encoding, incremental detokenization), loaded from the same files.

Where the core reads the folder's `tokenizer.json` itself, the HF tokenizer is loaded on first
use: generating from prompts never needs it, and loading it (with the transformers modules it
imports and a Python parse of tokenizer.json) took 1.18 s of a 10.4 s constructor in a profile on
the 2-core development machine, against 0.13 s now. A GGUF model's tokenizer files are converted
by transformers once and cached (`gguf_tokenizer`); after that it loads like a folder's.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ferrollm._core import Tokenizer
from ferrollm.config.model_source import ModelSource
from ferrollm.engine.gguf_tokenizer import gguf_tokenizer_files
from ferrollm.exceptions import TokenizerError


class Tokenizers:
    """The model's two tokenizers.

    Args:
        core: the Rust tokenizer the engine core uses.
        hf: the transformers tokenizer, or None with `load_hf`.
        load_hf: loads the transformers tokenizer on first use of `hf`.
        workdir: a temporary folder holding a materialized tokenizer.json, removed on close.
    """

    def __init__(self, core: Tokenizer, hf: Any = None, *, load_hf: Callable[[], Any] | None = None,
                 workdir: tempfile.TemporaryDirectory | None = None):
        self.core = core
        self._hf = hf
        self._load_hf = load_hf
        self.workdir = workdir

    @property
    def hf(self) -> Any:
        """The transformers tokenizer.

        Raises:
            TokenizerError: if it cannot be loaded.
        """
        if self._load_hf is not None:
            self._hf, self._load_hf = self._load_hf(), None
        return self._hf

    def close(self) -> None:
        if self.workdir is not None:
            self.workdir.cleanup()
            self.workdir = None


def load_tokenizers(source: ModelSource, tokenizer: str | None, revision: str | None = None) -> Tokenizers:
    """Loads both tokenizers. A GGUF model's tokenizer comes from the GGUF file unless
    `tokenizer` names another; a folder with `tokenizer.json` is read by the core directly (which
    drops any padding or truncation it asks for) and by transformers on first use; any other
    tokenizer is converted by transformers and written out once for the core."""
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


def _load_hf(where: Path, revision: str | None) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(where), revision=revision)
    except Exception as e:  # transformers raises OSError, ValueError, ... for unusable files
        raise TokenizerError(f"could not load the tokenizer from {where}: {e}") from e
