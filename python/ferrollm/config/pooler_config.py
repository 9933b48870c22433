"""How a model runs as a pooling (embedding) model: the `runner`/`convert` choice, the pooling
method, and what the checkpoint's sentence-transformers files say.

Precedence, as in vLLM: the user's ``pooler_config`` over the sentence-transformers config
(``modules.json`` + ``1_Pooling/config.json``; a ``Normalize`` module turns normalization on)
over the model's own default (CLS for BERT-like encoders, LAST for converted decoders; normalized).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ferrollm.exceptions import ConfigError

__all__ = [
    "POOLING_TYPES",
    "PoolerConfig",
    "PoolingModelConfig",
    "read_st_encoder_config",
    "read_st_pooling",
    "resolve_pooler",
    "resolve_runner",
]

logger = logging.getLogger(__name__)

# CLS: first token; LAST: last token; MEAN: average over the prompt; ALL: every token.
POOLING_TYPES = ("CLS", "LAST", "MEAN", "ALL")
RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed")

# sentence-transformers' Pooling flags -> pooling type; the other modes have no vLLM equivalent.
_ST_MODES = {
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_lasttoken": "LAST",
}
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"


@dataclass
class PoolerConfig:
    """Overrides of a pooling model's pooler, as vLLM's `LLM(pooler_config=...)`.

    Args:
        pooling_type: ``"CLS"``, ``"LAST"``, ``"MEAN"`` or ``"ALL"``; None keeps the model's.
        normalize: normalize embeddings by default; None keeps the model's.
    """

    pooling_type: str | None = None
    normalize: bool | None = None

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if not isinstance(self.pooling_type, str) or self.pooling_type.upper() not in POOLING_TYPES:
                raise ConfigError(f"`pooler_config.pooling_type` must be one of {list(POOLING_TYPES)}. "
                                  f"Given: {self.pooling_type!r}")
            self.pooling_type = self.pooling_type.upper()
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ConfigError(f"`pooler_config.normalize` must be True, False or None. Given: {self.normalize!r}")

    @classmethod
    def coerce(cls, value: Any) -> PoolerConfig:
        """Accepts None, a dict or a `PoolerConfig` (``seq_pooling_type`` is vLLM's newer name)."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, Mapping):
            known = {"pooling_type", "seq_pooling_type", "normalize"}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ConfigError(f"`pooler_config` keys must be among {sorted(known)}. Given: {unknown}")
            return cls(pooling_type=value.get("pooling_type", value.get("seq_pooling_type")),
                       normalize=value.get("normalize"))
        raise ConfigError(f"`pooler_config` must be a PoolerConfig, a dict or None. Given: {type(value).__name__}")


@dataclass(frozen=True)
class PoolingModelConfig:
    """The resolved pooler of a model running with ``runner="pooling"``.

    Attributes:
        pooling_type: one of `POOLING_TYPES`, used by the ``embed`` task.
        normalize: the default of `PoolingParams.normalize`.
        hidden_size: the embedding size.
        is_matryoshka: whether `PoolingParams.dimensions` may shorten embeddings.
        matryoshka_dimensions: the only allowed `dimensions`, when the config lists them.
        model_name: how errors name the model.
    """

    pooling_type: str
    normalize: bool
    hidden_size: int
    is_matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None
    model_name: str = ""


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"could not read {path}: {e}") from e


def read_st_pooling(folder: Path) -> tuple[str | None, bool | None]:
    """The pooling type and normalization a sentence-transformers checkpoint declares.

    Returns:
        ``(None, None)`` when the folder has no ``modules.json``; else the pooling type (None
        when its mode has no equivalent here) and whether a ``Normalize`` module follows.
    """
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None, None
    modules = _read_json(modules_file)
    normalize = any(m.get("type") == _ST_NORMALIZE for m in modules)
    pooling = next((m for m in modules if m.get("type") == _ST_POOLING), None)
    if pooling is None:
        return None, normalize
    config_file = folder / pooling.get("path", "") / "config.json"
    if not config_file.is_file():
        return None, normalize
    config = _read_json(config_file)
    enabled = sorted(k for k, v in config.items() if k.startswith("pooling_mode_") and v is True)
    if len(enabled) != 1 or enabled[0] not in _ST_MODES:
        logger.warning("sentence-transformers pooling %s has no equivalent here; using the model's default", enabled)
        return None, normalize
    return _ST_MODES[enabled[0]], normalize


def read_st_encoder_config(folder: Path) -> dict[str, Any]:
    """``sentence_bert_config.json`` (``max_seq_length``, ``do_lower_case``), or ``{}``."""
    path = folder / "sentence_bert_config.json"
    return dict(_read_json(path)) if path.is_file() else {}


def resolve_runner(runner: str, convert: str, architecture: str, pooling_only: bool,
                   has_st_pooling: bool) -> tuple[str, str]:
    """Picks ``(runner_type, convert_type)`` from the user's options, as vLLM does.

    ``runner="auto"`` means pooling for encoder-only architectures, for ``convert="embed"`` and
    for checkpoints with a sentence-transformers pooling config; generation otherwise.

    Raises:
        ConfigError: an unknown value, or a combination that cannot run (an encoder asked to
            generate, ``convert="embed"`` with ``runner="generate"``).
    """
    if runner not in RUNNERS:
        raise ConfigError(f"`runner` must be one of {list(RUNNERS)}. Given: {runner!r}")
    if convert not in CONVERTS:
        raise ConfigError(f"`convert` must be one of {list(CONVERTS)} (classify/reward conversions are not "
                          f"available yet). Given: {convert!r}")
    if runner == "auto":
        runner = "pooling" if pooling_only or convert == "embed" or has_st_pooling else "generate"
    if runner == "generate" and pooling_only:
        raise ConfigError(f"`runner` must be 'pooling' (or 'auto') for {architecture}: it is an encoder-only "
                          f"model and cannot generate text. Given: 'generate'")
    if runner == "generate" and convert == "embed":
        raise ConfigError("`convert='embed'` needs `runner` 'pooling' or 'auto'. Given: runner='generate'")
    if runner == "generate":
        return "generate", "none"
    return "pooling", "none" if pooling_only else "embed"


def resolve_pooler(user: PoolerConfig, st_pooling: tuple[str | None, bool | None],
                   model_default: str, hf_config: Any, model_name: str) -> PoolingModelConfig:
    """The pooler after applying the precedence described in the module docstring."""
    st_type, st_normalize = st_pooling
    pooling_type = user.pooling_type or st_type or model_default
    normalize = next((v for v in (user.normalize, st_normalize) if v is not None), True)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    text = getattr(hf_config, "text_config", None) or hf_config
    return PoolingModelConfig(
        pooling_type=pooling_type,
        normalize=normalize,
        hidden_size=int(text.hidden_size),
        is_matryoshka=bool(dims) or bool(getattr(hf_config, "is_matryoshka", False)),
        matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        model_name=model_name,
    )
