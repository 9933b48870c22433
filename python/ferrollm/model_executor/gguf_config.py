"""The HF config a GGUF file describes, built from an already parsed file the way transformers
builds it for ``AutoConfig.from_pretrained(folder, gguf_file=name)``.

transformers parses the file again for that (twice for a Llama file, with gguf-py's reader: ~9 s
of the constructor on the 2-core development machine). The renaming here uses transformers' own
tables (``GGUF_CONFIG_MAPPING``, ``GGUF_CONFIG_DEFAULTS_MAPPING``, and, where the installed version
has them, the per-architecture builders of ``transformers.integrations.gguf``), so configs stay
the ones transformers builds; ``tests/models/test_gguf.py`` compares the two. Architectures for
which transformers' loader does more than rename keys (reading tensors, rebuilding rope scaling)
are handed to transformers whole: slower, but the same config.

Importing a transformers 5 config class costs ~1.4 s on the development machine (LlamaConfig's
module pulls in `transformers.activations` and, through it, `torch.distributed.tensor`): more
than half of a SmolLM2 GGUF's start-up. What the class computes depends only on the file and the
transformers version, so the built config's attributes are cached (`ferrollm.file_cache`, keyed by
the metadata digest, the tensor names and that version) and later starts rebuild it as a plain
`PretrainedConfig` carrying the same attributes, without importing the class.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from transformers import PretrainedConfig

from ferrollm import file_cache
from ferrollm.exceptions import UnsupportedModelError
from ferrollm.model_executor.gguf_reader import GGUFFile

__all__ = ["gguf_config", "gguf_config_dict"]

logger = logging.getLogger(__name__)

# Architectures with steps of their own in transformers' `load_gguf_checkpoint` beyond renaming.
_HANDED_TO_TRANSFORMERS = ("t5", "stablelm", "gpt-oss", "gpt_oss", "minimax-m2", "lfm2")
# llama.cpp names these differently from transformers' model types.
_RENAMED_ARCHS = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe"}
# Architectures whose output projection transformers always ties to the embedding.
_ALWAYS_TIED = ("falcon", "bloom")


# Bump when what is cached changes.
_CACHE_FORMAT = "1"


def gguf_config(gguf: GGUFFile) -> PretrainedConfig:
    """The file's config, as ``AutoConfig.from_pretrained(folder, gguf_file=name)`` returns it
    (its attributes; from the second start on, on a plain `PretrainedConfig`).

    Raises:
        UnsupportedModelError: for an architecture transformers cannot read from GGUF.
    """
    key = _cache_key(gguf)
    cached = file_cache.read_json("gguf-configs", key)
    if cached is not None:
        config = _with_attributes(cached)
    else:
        config = _built_config(gguf)
        if not getattr(config, "architectures", None):
            config.architectures = [_causal_lm_arch(config.model_type)]
        try:
            file_cache.write_json("gguf-configs", key, config.to_dict())
        except (OSError, TypeError, ValueError) as e:  # a read-only home, or a value JSON cannot hold
            logger.info("GGUF config not cached (%s); it is rebuilt at every start", e)
    config.dtype = weights_dtype(gguf)
    return config


# The float types a GGUF file's matrices may be stored in, by GGML type id.
_FLOAT_TYPES = {0: "float32", 1: "float16", 30: "bfloat16"}


def weights_dtype(gguf: GGUFFile) -> str | None:
    """The dtype of a file whose matrices are stored in one float type (a BF16 or F16 GGUF, as
    `convert_hf_to_gguf --outtype` writes them), which ``dtype="auto"`` keeps as a checkpoint's
    ``torch_dtype``; None for quantized files, which compute in float32."""
    types = {t.ggml_type for t in gguf.tensors if len(t.shape) == 2}
    return _FLOAT_TYPES.get(types.pop()) if len(types) == 1 else None


def _causal_lm_arch(model_type: str) -> str:
    """The causal-LM class HF maps a model type to: GGUF metadata names a type, not a class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from ferrollm.model_executor.registry import ModelRegistry

    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if arch is None:
        raise UnsupportedModelError(
            f"GGUF model type {model_type!r} has no causal-LM architecture; supported "
            f"architectures: {ModelRegistry.get_supported_archs()}"
        )
    return arch


def _cache_key(gguf: GGUFFile) -> str:
    import transformers

    names = "\n".join(t.name for t in gguf.tensors)
    return file_cache.cache_key(_CACHE_FORMAT, gguf.metadata_digest, names, transformers.__version__)


def _with_attributes(values: dict[str, Any]) -> PretrainedConfig:
    """A config whose attributes are ``values`` (a config's ``to_dict()``), of a `PretrainedConfig`
    subclass that only names the model type. The base constructor drops a few values it leaves to
    subclasses (``use_cache``), so those are set back."""
    cls = type("CachedGGUFConfig", (PretrainedConfig,), {"model_type": values.get("model_type", "")})
    config = cls.from_dict(values)
    for name, value in values.items():
        if getattr(config, name, None) is None and value is not None:
            setattr(config, name, value)
    return config


def _built_config(gguf: GGUFFile) -> PretrainedConfig:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    tensor_names = [t.name for t in gguf.tensors]
    config_dict = gguf_config_dict(gguf.metadata, tensor_names)
    if config_dict is None:
        return _from_transformers(gguf)
    model_type = config_dict.get("model_type")
    if model_type == "mistral" and "layer_types" in config_dict:
        config_dict["model_type"] = model_type = "ministral"  # as AutoConfig.from_pretrained does
    if model_type not in CONFIG_MAPPING:
        raise UnsupportedModelError(f"GGUF model type {model_type!r} is unknown to transformers")
    return CONFIG_MAPPING[model_type].from_dict(config_dict)


def gguf_config_dict(metadata: dict[str, Any], tensor_names: Sequence[str]) -> dict[str, Any] | None:
    """The config dict transformers builds from this metadata, or ``None`` where only
    transformers' own loader builds it.

    Raises:
        UnsupportedModelError: for an architecture transformers cannot read from GGUF.
    """
    arch = str(metadata["general.architecture"])
    builders = _config_builders()
    if arch in builders:
        return builders[arch](_arrays_as_lengths(metadata), tuple(tensor_names))
    if any(name in arch for name in _HANDED_TO_TRANSFORMERS):
        return None
    return _renamed_config(metadata, tensor_names, arch)


def _renamed_config(metadata: dict[str, Any], tensor_names: Sequence[str], arch: str) -> dict[str, Any]:
    """transformers' generic path (`load_gguf_checkpoint`'s config half): every key whose prefix
    and name its `GGUF_CONFIG_MAPPING` knows, renamed, plus its defaults and a few fixes."""
    from transformers.integrations.ggml import (
        GGUF_CONFIG_DEFAULTS_MAPPING,
        GGUF_CONFIG_MAPPING,
    )

    updated = _updated_arch(metadata, arch)
    if arch not in GGUF_CONFIG_MAPPING and updated not in GGUF_CONFIG_MAPPING:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} is not one transformers reads; it reads {sorted(GGUF_CONFIG_MAPPING)}")
    config: dict[str, Any] = {
        "tie_word_embeddings": "output.weight" not in tensor_names or arch in _ALWAYS_TIED,
    }
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, GGUF_CONFIG_DEFAULTS_MAPPING.get(arch) or {})
    for key, value in defaults.items():
        config.setdefault(key, value)
    for key, value in metadata.items():
        prefix, _, name = key.replace(arch, updated).partition(".")
        renamed = GGUF_CONFIG_MAPPING.get(prefix, {}).get(name, -1)
        if renamed in (-1, None):
            continue
        # gguf-py hands a one-element array over as its element.
        if isinstance(value, list) and len(value) == 1:
            value = value[0]
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        config[renamed] = value
    if config.get("model_type") == "gemma3":
        config["model_type"] = "gemma3_text"  # the file holds the text backbone only
    if config.get("model_type") == "gemma4":
        config["model_type"] = "gemma4_text"
        config["eos_token_id"] = [1, 106, 50]  # transformers' fix: GGUF stores one of Gemma 4's three
    if "vocab_size" not in config and "tokenizer.ggml.tokens" in metadata:
        config["vocab_size"] = len(metadata["tokenizer.ggml.tokens"])
    return config


def _updated_arch(metadata: dict[str, Any], arch: str) -> str:
    """transformers' model type for llama.cpp's architecture name."""
    # transformers tests `"mistral" in [general.name]`: a Llama file named exactly "mistral".
    if "llama" in arch and metadata.get("general.name") == "mistral":
        return "mistral"
    for llama_cpp, hf in _RENAMED_ARCHS.items():
        if llama_cpp in arch:
            return hf
    return arch


def _config_builders() -> dict[str, Any]:
    """The per-architecture builders of newer transformers (which read the file's metadata
    with string arrays left as their lengths); none in older versions."""
    try:
        from transformers.integrations.gguf import GGUF_CONFIG_ARCHS
    except ImportError:
        return {}
    return dict(GGUF_CONFIG_ARCHS)


def _arrays_as_lengths(metadata: dict[str, Any]) -> dict[str, Any]:
    """The metadata as transformers' own reader hands it to those builders: arrays of strings
    (the vocabulary, the merges) as their lengths."""
    return {key: len(value) if isinstance(value, list) and value and isinstance(value[0], str) else value
            for key, value in metadata.items()}


def _from_transformers(gguf: GGUFFile) -> PretrainedConfig:
    from transformers import AutoConfig

    logger.info("GGUF architecture %r: config built by transformers' own GGUF loader (parses the file again)",
                gguf.architecture)
    return AutoConfig.from_pretrained(str(gguf.path.parent), gguf_file=gguf.path.name)
