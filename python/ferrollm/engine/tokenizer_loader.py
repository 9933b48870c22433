"""Tokenizers for one model: the HF tokenizer (chat templates, `get_tokenizer()`) and the Rust
core's tokenizer (batch encoding, incremental detokenization), loaded from the same files."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferrollm._core import Tokenizer
from ferrollm.config.model_source import ModelSource
from ferrollm.exceptions import TokenizerError


@dataclass
class Tokenizers:
    """Attributes:
    hf: the transformers tokenizer.
    core: the Rust tokenizer the engine core uses.
    workdir: a temporary folder holding a materialized tokenizer.json, removed on close.
    """

    hf: Any
    core: Tokenizer
    workdir: tempfile.TemporaryDirectory | None = None

    def close(self) -> None:
        if self.workdir is not None:
            self.workdir.cleanup()
            self.workdir = None


def load_tokenizers(source: ModelSource, tokenizer: str | None, revision: str | None = None) -> Tokenizers:
    """Loads both tokenizers. A GGUF model's tokenizer comes from the GGUF file unless
    `tokenizer` names another; a folder with `tokenizer.json` is read by the core directly, any
    other tokenizer is converted by transformers and written out once for the core."""
    from transformers import AutoTokenizer

    where = Path(tokenizer) if tokenizer else source.folder
    kwargs: dict[str, Any] = {}
    if tokenizer is None and source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file.name
    try:
        hf = AutoTokenizer.from_pretrained(str(where), revision=revision, **kwargs)
    except Exception as e:  # transformers raises OSError, ValueError, ... for unusable files
        raise TokenizerError(f"could not load the tokenizer from {where}: {e}") from e
    if not kwargs and (where / "tokenizer.json").is_file():
        return _from_tokenizer_json(hf, where)
    if not getattr(hf, "is_fast", False):
        raise TokenizerError(f"the tokenizer at {where} has no fast (tokenizers) version; ferrollm needs tokenizer.json")
    workdir = tempfile.TemporaryDirectory(prefix="ferrollm-tok-")
    hf.save_pretrained(workdir.name)
    return Tokenizers(hf, Tokenizer(workdir.name), workdir)


# The files the core reads beside tokenizer.json for its special token ids.
_SIDE_FILES = ("tokenizer_config.json", "generation_config.json", "config.json")


def _from_tokenizer_json(hf: Any, folder: Path) -> Tokenizers:
    """The core reads the folder's tokenizer.json directly, unless the file asks for padding or
    truncation (sentence-transformers exports often pad to a fixed length): the core would
    apply them to every prompt, so it gets a copy without them, beside copies of its side files.
    transformers ignores both settings unless a call asks for them."""
    config = json.loads((folder / "tokenizer.json").read_text())
    if config.get("padding") is None and config.get("truncation") is None:
        return Tokenizers(hf, Tokenizer(folder))
    config["padding"] = config["truncation"] = None
    workdir = tempfile.TemporaryDirectory(prefix="ferrollm-tok-")
    (Path(workdir.name) / "tokenizer.json").write_text(json.dumps(config))
    for name in _SIDE_FILES:
        if (folder / name).is_file():
            shutil.copy(folder / name, Path(workdir.name) / name)
    return Tokenizers(hf, Tokenizer(workdir.name), workdir)
