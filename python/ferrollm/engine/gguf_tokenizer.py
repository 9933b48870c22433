"""A GGUF model's tokenizer files (``tokenizer.json``, ``tokenizer_config.json``, the chat
template), converted once by transformers and cached under the file's metadata digest.

A GGUF file has no ``tokenizer.json``: transformers converts its vocabulary and merges into one,
which the Rust core's tokenizer then reads. That conversion (``AutoTokenizer.from_pretrained(
folder, gguf_file=name)``, which parses the file twice on the way) took ~6 s of the constructor
on the 2-core development machine for SmolLM2-135M. Its output depends only on the file's
metadata and the transformers version, so it is written once to
``$FERROLLM_CACHE_ROOT/gguf-tokenizers/<key>/`` (default root ``~/.cache/ferrollm``) and read from
there afterwards: ~0.1 s for the core's tokenizer; the HF tokenizer (chat templates) loads from
the same files on first use. The key hashes the metadata bytes, not the path, so a copied or
renamed file hits, and an edited one misses.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ferrollm.exceptions import TokenizerError
from ferrollm.file_cache import cache_key, cache_root
from ferrollm.model_executor.gguf_reader import open_gguf

__all__ = ["gguf_tokenizer_files"]

logger = logging.getLogger(__name__)

# Bump when what is written to a cache folder changes.
_CACHE_FORMAT = "1"


def gguf_tokenizer_files(gguf_file: Path) -> tuple[Path | None, Any | None]:
    """A folder with the GGUF file's tokenizer files, converting them first on a cache miss.

    Returns:
        ``(folder, hf)``: ``hf`` is the transformers tokenizer when this call converted it, else
        None (load it from ``folder`` when needed). ``folder`` is None when the cache could not
        be written (a read-only home): the caller writes ``hf`` out itself.

    Raises:
        TokenizerError: transformers cannot build a fast tokenizer from the file.
    """
    start = time.perf_counter()
    folder = cache_root() / "gguf-tokenizers" / _cache_key(gguf_file)
    if (folder / "tokenizer.json").is_file():
        logger.info("GGUF tokenizer of %s: cached at %s", gguf_file.name, folder)
        return folder, None
    hf = _convert(gguf_file)
    try:
        _write_atomically(hf, folder)
    except OSError as e:
        logger.warning("cannot cache the GGUF tokenizer at %s (%s); set FERROLLM_CACHE_ROOT to a writable "
                       "folder to skip the conversion next time", folder, e)
        return None, hf
    logger.info("GGUF tokenizer of %s: converted by transformers in %.2f s, cached at %s", gguf_file.name,
                time.perf_counter() - start, folder)
    return folder, hf


def _cache_key(gguf_file: Path) -> str:
    import tokenizers
    import transformers

    return cache_key(_CACHE_FORMAT, open_gguf(gguf_file).metadata_digest, transformers.__version__,
                     tokenizers.__version__)


def _convert(gguf_file: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    except Exception as e:  # transformers raises OSError, ValueError, ... for unusable files
        raise TokenizerError(f"could not build the tokenizer of {gguf_file}: {e}") from e
    if not getattr(hf, "is_fast", False):
        raise TokenizerError(f"the tokenizer of {gguf_file} has no fast (tokenizers) version; ferrollm needs tokenizer.json")
    return hf


def _write_atomically(hf: Any, folder: Path) -> None:
    """Writes into a fresh sibling folder and renames it into place, so a reader never sees half
    a folder and two engines converting at once both end with one complete copy."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".staging-", dir=folder.parent))
    try:
        hf.save_pretrained(str(staging))
        os.rename(staging, folder)
    except OSError:
        if not (folder / "tokenizer.json").is_file():
            raise
        # Another process put its copy in place first.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
