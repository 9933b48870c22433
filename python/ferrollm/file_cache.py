"""ferrollm's on-disk cache of what start-up derives from a checkpoint and would otherwise rebuild
every time (a GGUF file's tokenizer files and HF config): ``$FERROLLM_CACHE_ROOT``, default
``~/.cache/ferrollm``. Entries are keyed by a digest of what they were built from, so a stale
entry is never read; writes are atomic, so a reader never sees half an entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["cache_key", "cache_root", "read_json", "write_json"]


def cache_root() -> Path:
    """``$FERROLLM_CACHE_ROOT``, else ``~/.cache/ferrollm``."""
    return Path(os.environ.get("FERROLLM_CACHE_ROOT") or Path.home() / ".cache" / "ferrollm").expanduser()


def cache_key(*parts: str) -> str:
    """A short digest of ``parts`` (the inputs an entry was built from, and versions)."""
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def read_json(kind: str, key: str) -> Any | None:
    """The JSON entry ``kind/key``, or None when there is none (or it cannot be read)."""
    try:
        return json.loads((cache_root() / kind / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None


def write_json(kind: str, key: str, value: Any) -> None:
    """Writes the entry ``kind/key`` through a temporary file renamed into place.

    Raises:
        OSError: the cache folder cannot be written (callers log it and go on).
    """
    folder = cache_root() / kind
    folder.mkdir(parents=True, exist_ok=True)
    fd, staging = tempfile.mkstemp(prefix=".staging-", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(staging, folder / f"{key}.json")
    finally:
        if os.path.exists(staging):
            os.unlink(staging)
