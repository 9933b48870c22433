"""Quantized checkpoints and ``quantization=``, in vLLM's terms.

`resolve_quantization` decides a model's method once, before loading: from ``config.json``'s
``quantization_config`` (no argument needed), a GGUF file, or the ``quantization`` argument (which
may name the checkpoint's own method, or quantize a float checkpoint as it loads). The model
loader then gives each linear layer its `LinearQuantMethod` (`attach_quant_methods`).
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from ferrollm.exceptions import ConfigError
from ferrollm.model_executor.layers.quantization.base_config import LinearQuantMethod, QuantizationConfig
from ferrollm.model_executor.layers.quantization.compressed_tensors import CompressedTensorsConfig
from ferrollm.model_executor.layers.quantization.dynamic_int import Int8Config, RTNConfig
from ferrollm.model_executor.layers.quantization.fp8 import Fp8Config
from ferrollm.model_executor.layers.quantization.gguf import GGUFConfig
from ferrollm.model_executor.layers.quantization.gptq import AWQConfig, GPTQConfig

__all__ = ["QUANTIZATION_METHODS", "LinearQuantMethod", "QuantizationConfig", "attach_quant_methods", "log_quantized_bytes",
           "resolve_quantization"]

logger = logging.getLogger(__name__)

_CONFIGS: tuple[type[QuantizationConfig], ...] = (CompressedTensorsConfig, GPTQConfig, AWQConfig, Fp8Config,
                                                  GGUFConfig, Int8Config, RTNConfig)
# Methods that quantize a float checkpoint as it loads.
_DYNAMIC = {"fp8": Fp8Config, "int8": Int8Config, "rtn": RTNConfig}
_BY_NAME = {name: cls for cls in _CONFIGS for name in (cls.name, *cls.aliases)}

QUANTIZATION_METHODS = tuple(sorted(_BY_NAME))


def resolve_quantization(hf_config: Any, quantization: str | None, is_gguf: bool) -> QuantizationConfig | None:
    """The model's quantization, or None for a float model.

    Args:
        hf_config: the model's config; its ``quantization_config`` names a static method.
        quantization: the ``quantization`` argument (None: the checkpoint's own method).
        is_gguf: the model is a GGUF file.

    Raises:
        ConfigError: an unknown method (listing the supported ones), a checkpoint method ferrollm
            does not read, or an argument that contradicts the checkpoint (naming both).
    """
    if quantization is not None and quantization not in _BY_NAME:
        raise ConfigError(f"`quantization` must be one of {list(QUANTIZATION_METHODS)} or None. Given: {quantization!r}")
    stored = _stored_config(hf_config)
    if is_gguf:
        stored_name, stored_cfg = "gguf", None
    elif stored is not None:
        stored_name, stored_cfg = _stored_method(stored), stored
    else:
        stored_name, stored_cfg = None, None
    if stored_name is None:
        if quantization is None:
            return None
        if quantization not in _DYNAMIC:
            raise ConfigError(f"`quantization={quantization!r}` needs a checkpoint quantized with it (its config.json "
                              f"has no quantization_config); methods that quantize a float checkpoint at load: "
                              f"{sorted(_DYNAMIC)}")
        return _DYNAMIC[quantization].from_config(None)
    if stored_name not in _BY_NAME:
        raise ConfigError(f"the checkpoint's quantization method {stored_name!r} is not supported; supported: "
                          f"{list(QUANTIZATION_METHODS)}")
    cls = _BY_NAME[stored_name]
    if quantization is not None and _BY_NAME[quantization] is not cls:
        raise ConfigError(f"`quantization={quantization!r}` contradicts the checkpoint, which is quantized with "
                          f"{stored_name!r}; pass quantization={stored_name!r} or leave it out")
    return cls.from_config(stored_cfg)


def _stored_config(hf_config: Any) -> dict[str, Any] | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is None:
        return None
    return config if isinstance(config, dict) else config.to_dict()


def _stored_method(config: dict[str, Any]) -> str:
    method = str(config.get("quant_method", "")).lower()
    if method == "gptq" and config.get("checkpoint_format") == "marlin":
        return "gptq_marlin"
    return method


def attach_quant_methods(model: nn.Module, config: QuantizationConfig, device) -> int:
    """Gives each linear layer of ``model`` its method (before loading); returns how many."""
    from ferrollm.model_executor.layers.linear import LinearBase

    from ferrollm.model_executor.layers.fused_moe import FusedMoE

    if any(isinstance(m, FusedMoE) for m in model.modules()):
        if config.name not in _DYNAMIC:
            raise ConfigError(f"{config.describe()}: quantized MoE experts are not supported yet; supported for "
                              "MoE models: the float checkpoint, or quantization in "
                              f"{sorted(_DYNAMIC)} (which quantizes the attention and dense layers and "
                              "leaves the experts in floating point)")
        logger.warning("quantization=%r leaves the MoE experts in floating point (no quantized expert kernels yet)",
                       config.name)
    fused = _fused_layers(model)
    if hasattr(config, "fused"):
        config.fused = fused
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, LinearBase):
            method = config.get_linear_method(name)
            if method is not None:
                module.set_quant_method(method, device)
                count += 1
    logger.info("quantization: %s on %d linear layers", config.describe(), count)
    return count


def _fused_layers(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """The model's fused layers and the checkpoint projections each holds (``qkv_proj`` ->
    ``q_proj, k_proj, v_proj``), from its ``stacked_params_mapping``."""
    fused: dict[str, list[str]] = {}
    for fused_name, part, _ in getattr(model, "stacked_params_mapping", ()) or ():
        parts = fused.setdefault(fused_name.strip("."), [])
        if part.strip(".") not in parts:
            parts.append(part.strip("."))
    return {k: tuple(v) for k, v in fused.items()}


def log_quantized_bytes(model: nn.Module, dtype) -> None:
    """Logs what the quantized layers hold against what their weights would take in ``dtype``."""
    from ferrollm.model_executor.layers.quantization.forms import QuantizedLinear

    held, unquantized, gguf_file, gguf_held = {}, 0, 0, 0
    for module in model.modules():
        form = getattr(module, "_cpu", None)
        if isinstance(form, QuantizedLinear):
            held.update(form.tensors())
            unquantized += module.weight.numel() * module.weight.element_size()
            if form.gguf_file_bytes:
                gguf_file += form.gguf_file_bytes
                gguf_held += sum(form.tensors().values())
    mib = 1 << 20
    if held:
        logger.info("quantized linear weights: %.1f MiB, from %.1f MiB in %s (%.2fx smaller)",
                    sum(held.values()) / mib, unquantized / mib, str(dtype).replace("torch.", ""),
                    unquantized / max(sum(held.values()), 1))
    if gguf_file:
        logger.info("GGUF projections: %.1f MiB of the file's blocks held as %.1f MiB of codes and float32 group "
                    "scales for the Triton kernels (5- and 6-bit codes take a byte each)", gguf_file / mib, gguf_held / mib)
