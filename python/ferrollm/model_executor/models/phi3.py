"""Phi-3 (and Phi-4, which reuses the architecture): Llama's block with q/k/v and gate/up stored
fused in the checkpoint (``qkv_proj``, ``gate_up_proj``), partial rotary when
``partial_rotary_factor`` < 1, and one ``sliding_window`` for every layer when set.

The long-context RoPE scalings (``longrope``, formerly ``su``/``yarn``) switch between two
frequency tables depending on the whole sequence's length, so keys cached early would be rotated
with the other table than transformers uses; those checkpoints are refused.
"""

from __future__ import annotations

from dataclasses import replace

from transformers import PretrainedConfig

from ferrollm.exceptions import UnsupportedModelError
from ferrollm.model_executor.models.llama import LayerOptions, LlamaForCausalLM

__all__ = ["Phi3ForCausalLM"]

_LONG_ROPE_TYPES = ("longrope", "su", "yarn")


class Phi3ForCausalLM(LlamaForCausalLM):
    """Phi-3 decoder with an LM head.

    Args:
        config: the HF ``Phi3Config``.
        dtype: parameter and activation dtype.

    Raises:
        UnsupportedModelError: for ``longrope``/``su``/``yarn`` RoPE scaling (the 128k-context
            checkpoints); the 4k/8k/16k ones use the default RoPE.
    """

    # The checkpoint stores the fused tensors; their loaders split them per rank.
    stacked_params_mapping: list = []

    @classmethod
    def layer_options(cls, config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        opts = super().layer_options(config, layer_idx)
        rope = dict(opts.rope)
        if rope["rope_type"] in _LONG_ROPE_TYPES:
            raise UnsupportedModelError(
                f"Phi-3 rope_type {rope['rope_type']!r} (long-context scaling) is not supported; "
                "only checkpoints with the default RoPE (rope_scaling null, e.g. "
                "Phi-3-mini-4k-instruct, Phi-4) are"
            )
        # Older configs keep the factor at the top level rather than in rope_parameters.
        rope.setdefault("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        return replace(opts, rope=rope, qkv_bias=False, o_bias=False, mlp_bias=False,
                       sliding_window=getattr(config, "sliding_window", None))
