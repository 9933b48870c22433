"""Gemma 3, text only (``Gemma3ForCausalLM``, e.g. gemma-3-1b): Gemma 2's block with an RMSNorm
over each q and k head, sliding and global layers with their own RoPE bases, and no attention
soft-capping.

RoPE settings come per layer type. transformers >= 5 keeps them as
``rope_parameters = {"sliding_attention": {...}, "full_attention": {...}}``; older configs have
``rope_local_base_freq`` for the sliding layers and ``rope_theta`` (+ ``rope_scaling``) for the
global ones.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from transformers import PretrainedConfig

from ferrollm.model_executor.layers.rotary import rope_parameters
from ferrollm.model_executor.models.gemma2 import Gemma2ForCausalLM
from ferrollm.model_executor.models.llama import LayerOptions
from ferrollm.model_executor.models.utils import layer_sliding_window

__all__ = ["Gemma3ForCausalLM", "gemma3_rope_parameters"]

# transformers' default sliding_window_pattern: every sixth layer is global.
_DEFAULT_SLIDING_WINDOW_PATTERN = 6


def gemma3_rope_parameters(config: PretrainedConfig, sliding: bool) -> dict[str, Any]:
    """The RoPE settings of Gemma 3's sliding (``sliding=True``) or global layers, in the form
    :func:`rope_parameters` returns, from either config layout."""
    layer_type = "sliding_attention" if sliding else "full_attention"
    per_type = getattr(config, "rope_parameters", None) or {}
    if isinstance(per_type.get(layer_type), dict):
        params = dict(per_type[layer_type])
        params.setdefault("rope_type", params.pop("type", "default"))
        return params
    if sliding:
        # The old layout scales only the global layers' RoPE.
        return {"rope_type": "default", "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    return rope_parameters(config)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    """Gemma 3 text decoder with an LM head tied to the embedding.

    Args:
        config: the HF ``Gemma3TextConfig``. ``attn_logit_softcapping`` is ignored, as transformers
            ignores it; ``final_logit_softcapping`` is applied when set.
        dtype: parameter and activation dtype.

    Raises:
        UnsupportedModelError: for ``use_bidirectional_attention``.
    """

    @classmethod
    def layer_options(cls, config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        pattern = getattr(config, "sliding_window_pattern", None) or _DEFAULT_SLIDING_WINDOW_PATTERN
        window = layer_sliding_window(config, layer_idx, (layer_idx + 1) % pattern != 0)
        return replace(super().layer_options(config, layer_idx), qk_norm=True, logits_soft_cap=None,
                       sliding_window=window, rope=gemma3_rope_parameters(config, window is not None))
