"""`ModelConfig`: the HF config of the model to run, with `hf_overrides` applied, its
architecture resolved, whether it generates or pools, and the dtype and `max_model_len` decided."""

from __future__ import annotations

import copy
import functools
import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ferrollm.config.model_source import ModelSource
from ferrollm.config.pooler_config import (
    PoolerConfig,
    PoolingModelConfig,
    read_st_encoder_config,
    read_st_pooling,
    resolve_pooler,
    resolve_runner,
)
from ferrollm.exceptions import ConfigError

logger = logging.getLogger(__name__)

HfOverrides = Mapping[str, Any] | Callable[[Any], Any] | None

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def apply_hf_overrides(hf_config: Any, overrides: HfOverrides) -> Any:
    """Applies `hf_overrides` as vLLM does: a dict is merged into the config (nested dicts merge
    into nested configs and dict attributes), a callable receives the config and returns it."""
    if overrides is None:
        return hf_config
    if callable(overrides):
        return overrides(hf_config)
    if not isinstance(overrides, Mapping):
        raise ConfigError(f"`hf_overrides` must be a dict or a callable. Given: {type(overrides).__name__}")
    for key, value in overrides.items():
        current = getattr(hf_config, key, None)
        if isinstance(value, Mapping) and isinstance(current, Mapping):
            merged = copy.deepcopy(dict(current))
            merged.update(value)
            setattr(hf_config, key, merged)
        elif isinstance(value, Mapping) and current is not None and hasattr(current, "to_dict"):
            apply_hf_overrides(current, value)
        else:
            setattr(hf_config, key, value)
    return hf_config


def cpu_has_native_bf16() -> bool:
    """Whether this CPU has native bf16 dot products (AVX512-BF16's ``vdpbf16ps`` or AMX tiles),
    from the kernel's flags in /proc/cpuinfo (False where that file is missing: macOS, ARM).
    ``FERROLLM_CPU_NATIVE_BF16=0``/``1`` overrides the answer: the tests pin it to 0 so their
    fp32 checkpoints keep running fp32 (and greedy parity stays exact) on any CPU."""
    forced = os.environ.get("FERROLLM_CPU_NATIVE_BF16")
    if forced in ("0", "1"):
        return forced == "1"
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16"})


@functools.cache
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            for line in info:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def resolve_dtype(dtype: str | torch.dtype, config_dtype: Any, device: torch.device) -> torch.dtype:
    """The dtype weights and activations run in; ``"auto"`` is decided from the checkpoint's
    ``torch_dtype`` and the device, and logged at INFO with its reason.

    On CUDA, ``auto`` keeps the checkpoint's dtype (fp32 checkpoints run in bf16). On the CPU:
    bf16 checkpoints run bf16; fp16 ones run bf16 too (the CPU kernels have no fp16 path, and bf16
    keeps fp16's range); fp32 ones run bf16 only where the CPU has native bf16 dot products
    (`cpu_has_native_bf16`), else fp32, where fp32 matmuls are the faster ones. An explicit
    dtype (``"float32"``) always wins.

    vLLM's CPU platform (vllm/platforms/cpu.py ``supported_dtypes``, resolved by its model
    config's auto-dtype rule) lists bf16 first on x86, so it turns fp32 checkpoints into bf16 on
    every x86 CPU, with or without native bf16; and it keeps fp16 checkpoints fp16. We differ on
    both: fp32 stays fp32 without native bf16 (bf16 there is converted in registers and buys
    only memory), and fp16 becomes bf16.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ConfigError(f"`dtype` must be 'auto' or one of {sorted(_DTYPES)}. Given: {dtype!r}")
        return _DTYPES[dtype]
    cfg = config_dtype if isinstance(config_dtype, torch.dtype) else _DTYPES.get(str(config_dtype).removeprefix("torch."))
    if device.type != "cpu":
        cfg = cfg or torch.bfloat16
        return torch.bfloat16 if cfg == torch.float32 else cfg
    resolved, reason = _resolve_cpu_auto(cfg)
    logger.info("dtype='auto' resolved to %s on the CPU: %s", str(resolved).removeprefix("torch."), reason)
    return resolved


def _resolve_cpu_auto(cfg: torch.dtype | None) -> tuple[torch.dtype, str]:
    if cfg in (torch.bfloat16, torch.float16):
        name = "bf16" if cfg == torch.bfloat16 else "fp16 (no fp16 CPU kernels; bf16 keeps its range)"
        return torch.bfloat16, f"the checkpoint is {name}"
    what = "fp32" if cfg == torch.float32 else f"{cfg or 'unknown'}"
    if cpu_has_native_bf16():
        return torch.bfloat16, f"the checkpoint is {what} and this CPU has native bf16 dot products (AVX512-BF16/AMX)"
    return torch.float32, f"the checkpoint is {what} and this CPU has no native bf16 dot products (AVX512-BF16/AMX)"


def text_config_of(hf_config: Any) -> Any:
    """The decoder's config: ``text_config`` of a multimodal model, else the config itself."""
    return getattr(hf_config, "text_config", None) or hf_config


def derive_max_model_len(hf_config: Any) -> int:
    """The longest sequence the checkpoint supports, from its config."""
    text = getattr(hf_config, "text_config", None) or hf_config
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        value = getattr(text, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


@dataclass
class ModelConfig:
    """What the engine needs to know about the model.

    Attributes:
        source: where the files are.
        hf_config: the transformers config, overrides applied.
        architecture: the architecture chosen from `hf_config.architectures`.
        dtype: the dtype weights and activations run in.
        max_model_len: the longest sequence (prompt + output) a request may reach; for a
            pooling model, the longest prompt.
        runner_type: ``"generate"`` or ``"pooling"``.
        convert_type: ``"embed"`` when a generative architecture runs as an embedder, else
            ``"none"``.
        pooler: the resolved pooler of a pooling model, else None.
        do_lower_case: lower-case text prompts before tokenizing (sentence-transformers'
            ``do_lower_case``).
        quant_config: the weights' quantization (`resolve_quantization`), None for float weights.
    """

    source: ModelSource
    hf_config: Any
    architecture: str
    dtype: torch.dtype
    max_model_len: int
    runner_type: str = "generate"
    convert_type: str = "none"
    pooler: PoolingModelConfig | None = None
    do_lower_case: bool = False
    quant_config: Any = None

    @property
    def is_pooling(self) -> bool:
        return self.runner_type == "pooling"

    @property
    def hf_text_config(self) -> Any:
        """The language model's part of the config (the config itself for text-only models)."""
        return getattr(self.hf_config, "text_config", None) or self.hf_config

    def get_vocab_size(self) -> int:
        """The model's vocabulary size (vLLM's `get_vocab_size`)."""
        return int(self.hf_text_config.vocab_size)

    def get_hidden_size(self) -> int:
        """The model's hidden size (vLLM's `get_hidden_size`)."""
        return int(self.hf_text_config.hidden_size)

    @property
    def embedding_size(self) -> int:
        """The length of a pooling model's embeddings, as vLLM's `embedding_size`: the config's
        own `embedding_size` when it sets one, else the hidden size (ferrollm applies no
        sentence-transformers Dense layer, so the pooled hidden state is the embedding)."""
        override = getattr(self.hf_config, "embedding_size", None)
        return int(override) if override is not None else self.get_hidden_size()


def build_model_config(
    source: ModelSource,
    hf_config: Any,
    *,
    hf_overrides: HfOverrides,
    dtype: str | torch.dtype,
    max_model_len: int | None,
    device: torch.device,
    runner: str = "auto",
    convert: str = "auto",
    pooler_config: Any = None,
    quantization: str | None = None,
) -> ModelConfig:
    """Applies overrides, resolves the architecture and the runner, and checks `max_model_len`
    against the model.

    Raises:
        ConfigError: an unknown architecture (naming it, the supported list and `hf_overrides`),
            an unknown dtype, runner or convert option, a `max_model_len` above what the
            model supports, or a `quantization` the checkpoint does not allow.
    """
    from ferrollm.model_executor.registry import ModelRegistry

    hf_config = apply_hf_overrides(hf_config, hf_overrides)
    architectures = list(getattr(hf_config, "architectures", None) or [])
    architecture = ModelRegistry.resolve_name(architectures)
    st_pooling = read_st_pooling(source.folder) if source.gguf_file is None else (None, None)
    runner_type, convert_type = resolve_runner(
        runner, convert, architecture, ModelRegistry.is_pooling_only(architectures),
        has_st_pooling=st_pooling != (None, None),
    )
    pooler, encoder_config = None, {}
    if runner_type == "pooling":
        model_cls = ModelRegistry.resolve(architectures)
        default_type = getattr(model_cls, "default_pooling_type", "LAST")
        pooler = resolve_pooler(PoolerConfig.coerce(pooler_config), st_pooling, default_type, hf_config,
                                source.gguf_file.name if source.gguf_file else source.folder.name)
        encoder_config = read_st_encoder_config(source.folder)
    elif pooler_config is not None:
        raise ConfigError("`pooler_config` applies to pooling models only; pass runner='pooling' as well")
    derived = derive_max_model_len(hf_config)
    if isinstance(encoder_config.get("max_seq_length"), int):
        # sentence-transformers truncates at its own max_seq_length; vLLM caps the length there.
        derived = min(derived, encoder_config["max_seq_length"])
    if max_model_len is None:
        max_model_len = derived
    elif max_model_len < 2:
        raise ConfigError(f"`max_model_len` must be >= 2. Given: {max_model_len}")
    elif max_model_len > derived:
        raise ConfigError(
            f"`max_model_len` must be <= {derived}, the model's maximum (max_position_embeddings "
            f"in its config, or max_seq_length in sentence_bert_config.json). Given: {max_model_len}"
        )
    resolved = resolve_dtype(dtype, getattr(hf_config, "dtype", None), device)
    from ferrollm.model_executor.layers.quantization import resolve_quantization

    quant_config = resolve_quantization(hf_config, quantization, is_gguf=source.gguf_file is not None)
    return ModelConfig(source, hf_config, architecture, resolved, max_model_len, runner_type, convert_type,
                       pooler, bool(encoder_config.get("do_lower_case", False)), quant_config)
