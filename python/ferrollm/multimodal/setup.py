"""Builds the engine's multimodal processor from `LLM`'s options (`limit_mm_per_prompt`,
`mm_processor_kwargs`, `mm_processor_cache_gb`), or none for a text model."""

from __future__ import annotations

import logging
from typing import Any

from ferrollm.exceptions import ConfigError
from ferrollm.multimodal.cache import MultiModalInputCache, cache_capacity_bytes
from ferrollm.multimodal.processor import MultiModalProcessor, check_limits

__all__ = ["MultiModalProcessor", "build_mm_processor", "is_multimodal"]

logger = logging.getLogger(__name__)


def is_multimodal(model_config) -> bool:
    """Whether the resolved model class takes images."""
    from ferrollm.model_executor.registry import ModelRegistry

    archs = list(getattr(model_config.hf_config, "architectures", None) or [])
    return bool(getattr(ModelRegistry.resolve(archs), "supports_multimodal", False))


def build_mm_processor(args: Any, model_config) -> MultiModalProcessor | None:
    """The processor of a multimodal model; None for a text model. When every modality's limit
    is 0 the model config is marked text-only, so the vision tower is not built.

    Raises:
        ConfigError: multimodal options on a text model, bad limits or processor kwargs.
    """
    if model_config.is_pooling or not is_multimodal(model_config):
        given = [n for n in ("limit_mm_per_prompt", "mm_processor_kwargs") if getattr(args, n, None)]
        if given:
            raise ConfigError(f"`{given[0]}` applies to multimodal models only; {model_config.architecture} "
                              "takes text only")
        return None
    from ferrollm.model_executor.models.qwen2_vl import TEXT_ONLY_ATTR

    cls = _processor_class(model_config.hf_config)
    limits = check_limits(args.limit_mm_per_prompt, cls.modalities)
    text_only = (all(limits[m] == 0 for m in cls.modalities)
                 or bool(getattr(args, "language_model_only", False)))
    if text_only:
        # The processor still runs, to refuse images with the limit in the message.
        limits = dict.fromkeys(limits, 0)
        setattr(model_config.hf_config, TEXT_ONLY_ATTR, True)
        logger.info("limit_mm_per_prompt is 0 for every modality (or language_model_only): the vision tower "
                    "is not loaded")
    folder = model_config.source.folder
    cache = MultiModalInputCache(cache_capacity_bytes(args.mm_processor_cache_gb))
    return cls(folder, model_config.hf_config, limits, args.mm_processor_kwargs, cache)


def _processor_class(hf_config) -> type[MultiModalProcessor]:
    """The model's processor class; its `modalities` say what `multi_modal_data` may hold."""
    model_type = getattr(hf_config, "model_type", None)
    if model_type == "gemma3":
        from ferrollm.multimodal.gemma3_processor import Gemma3MultiModalProcessor
        return Gemma3MultiModalProcessor
    if model_type == "internvl":
        from ferrollm.multimodal.internvl_processor import InternVLMultiModalProcessor
        return InternVLMultiModalProcessor
    if model_type == "internvl_chat":
        from ferrollm.multimodal.internvl_processor import InternVLChatMultiModalProcessor
        return InternVLChatMultiModalProcessor
    if model_type == "fuyu":
        from ferrollm.multimodal.fuyu_processor import FuyuMultiModalProcessor
        return FuyuMultiModalProcessor
    if model_type in ("qwen2_vl", "qwen2_5_vl"):
        from ferrollm.multimodal.qwen2_vl_processor import Qwen2VLMultiModalProcessor
        return Qwen2VLMultiModalProcessor
    return MultiModalProcessor
