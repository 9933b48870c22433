"""The model's recommended sampling defaults from ``generation_config.json``, as vLLM applies
them with ``generation_config="auto"``: `LLM.generate` without sampling parameters uses them.

Only the sampler's fields are taken (``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty``; ``max_new_tokens`` becomes ``max_tokens``); ``do_sample`` and the rest
are ignored, as in vLLM. The EOS ids in the file reach the Rust tokenizer separately.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ferrollm.exceptions import ConfigError

__all__ = ["default_sampling_fields"]

logger = logging.getLogger(__name__)

_SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def _read(folder: Path) -> dict[str, Any]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"could not read {path}: {e}") from e
    return data if isinstance(data, dict) else {}


def default_sampling_fields(generation_config: str, model_folder: Path,
                            overrides: Mapping[str, Any] | None = None, has_file: bool = True) -> dict[str, Any]:
    """The `SamplingParams` fields the model's generation config sets.

    Args:
        generation_config: ``"auto"`` (the model folder's file), ``"vllm"`` (none: vLLM's
            neutral defaults), or a folder holding a ``generation_config.json``.
        model_folder: the checkpoint folder.
        overrides: vLLM's ``override_generation_config``, merged over the file.
        has_file: False for a GGUF model, whose folder's files belong to no checkpoint.

    Returns:
        ``SamplingParams`` keyword arguments (``max_new_tokens`` renamed ``max_tokens``).

    Raises:
        ConfigError: a folder that does not exist, or an unreadable file.
    """
    if not isinstance(generation_config, str):
        raise ConfigError(f"`generation_config` must be 'auto', 'vllm' or a folder. Given: {generation_config!r}")
    if generation_config == "vllm":
        config: dict[str, Any] = {}
    elif generation_config == "auto":
        config = _read(model_folder) if has_file else {}
    else:
        folder = Path(generation_config).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"`generation_config` must be 'auto', 'vllm' or an existing folder. Given: {generation_config!r}")
        config = _read(folder)
    config.update(overrides or {})
    fields = {k: config[k] for k in _SAMPLING_FIELDS if config.get(k) is not None}
    if "max_new_tokens" in fields:
        fields["max_tokens"] = fields.pop("max_new_tokens")
    if fields:
        logger.info("Default sampling parameters come from the model's generation config: %s "
                    "(pass generation_config='vllm' to ignore it).", fields)
    return fields
