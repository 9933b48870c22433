"""Where a model's files come from: a local folder, a local `.gguf` file, or a Hugging Face hub
id resolved through `huggingface_hub` (its cache first; `HF_HUB_OFFLINE` honoured)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ferrollm.exceptions import ConfigError

_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")


@dataclass(frozen=True)
class ModelSource:
    """A resolved model location.

    Attributes:
        folder: the folder holding `config.json` and weights (or the GGUF file's folder).
        gguf_file: the GGUF file when the model is one, else None.
    """

    folder: Path
    gguf_file: Path | None = None

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on")


def resolve_model_source(model: str | os.PathLike[str], revision: str | None = None,
                         download_dir: str | os.PathLike[str] | None = None,
                         hf_token: bool | str | None = None) -> ModelSource:
    """Resolves `model` the way users of vLLM expect.

    Args:
        model: a local folder, a `.gguf` file, or a hub id such as `org/name`.
        revision: the hub revision, for hub ids.
        download_dir: the Hugging Face cache folder to find or fetch a hub id in (vLLM's
            `download_dir`); None: huggingface_hub's default cache.
        hf_token: the hub token for private or gated repositories (True: the one
            `huggingface-cli login` stored; None: huggingface_hub's default).

    Returns:
        The local location of the model's files.

    Raises:
        ConfigError: the path does not exist and the hub id can be neither found in the cache
            nor fetched; the message says which and how to pass a local folder instead.
    """
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"`model` must be a folder or a .gguf file. Given: the file {path}")
        return ModelSource(folder=path.parent, gguf_file=path)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"`model` folder {path} has no config.json: a Hugging Face checkpoint folder is needed")
        return ModelSource(folder=path)
    if not _HUB_ID.match(str(model)):
        raise ConfigError(f"`model` must be a local folder, a .gguf file or a hub id like `org/name`. Given: {model!r} (no such path)")
    return ModelSource(folder=_from_hub(str(model), revision, download_dir, hf_token))


def _from_hub(repo_id: str, revision: str | None, download_dir: str | os.PathLike[str] | None = None,
              hf_token: bool | str | None = None) -> Path:
    from huggingface_hub import snapshot_download

    offline = _offline()
    try:
        return Path(snapshot_download(repo_id, revision=revision, local_files_only=offline, token=hf_token,
                                      cache_dir=None if download_dir is None else str(download_dir)))
    except Exception as e:  # the hub library raises many kinds; all mean "not available"
        cache = f"the cache at download_dir={str(download_dir)!r}" if download_dir is not None else "the local cache"
        how = f"HF_HUB_OFFLINE is set, so only {cache} was searched" if offline else "it could not be fetched from the hub"
        raise ConfigError(
            f"model `{repo_id}` is not a local path, is not in the Hugging Face cache, and {how} "
            f"({type(e).__name__}). Download it elsewhere and pass the local folder: LLM(model='/path/to/folder')"
        ) from e
