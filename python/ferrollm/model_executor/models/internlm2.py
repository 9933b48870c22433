"""InternLM2 (``InternLM2ForCausalLM``, remote code on the hub; the text model of InternVL2):
Llama's block under other names, with one fused ``wqkv`` and ``bias`` on ``wqkv`` and ``wo``.

It runs on the Llama code path (paged attention, TP-aware linear layers, the CPU decoder): the
checkpoint's names are translated at load by :func:`internlm2_to_llama`. ``wqkv``'s rows are
grouped per KV head, ``[q_0 .. q_{g-1}, k, v]`` for each of the ``num_key_value_heads`` groups
(``g = num_attention_heads / num_key_value_heads``), as the remote code's ``view(..., g + 2,
head_dim)`` reads them; they are regrouped into q, k and v and go through ``qkv_proj``'s own
loader, which shards them per rank like any Llama's.

``rope_scaling`` of type ``dynamic`` (InternLM2's NTK scaling) rotates exactly as plain RoPE up to
``max_position_embeddings``, the most ``max_model_len`` may be, so it runs as plain RoPE.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace

import torch
from transformers import PretrainedConfig

from ferrollm.model_executor.models.llama import LayerOptions, LlamaForCausalLM, head_dim_of

__all__ = ["InternLM2ForCausalLM", "internlm2_to_llama"]

# InternLM2 name piece -> Llama's (applied to the name after `model.`/before `.weight`).
_RENAMES = (
    ("model.tok_embeddings.", "model.embed_tokens."),
    (".attention.wo.", ".self_attn.o_proj."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".attention_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
)


def split_wqkv(tensor: torch.Tensor, config: PretrainedConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``wqkv``'s weight ``[(h + 2 * kv) * d, hidden]`` (or bias ``[(h + 2 * kv) * d]``), grouped
    per KV head, as Llama's q ``[h * d, ...]``, k and v ``[kv * d, ...]`` (views, no copy)."""
    kv, d = int(config.num_key_value_heads), head_dim_of(config)
    group = int(config.num_attention_heads) // kv
    grouped = tensor.unflatten(0, (kv, group + 2, d))
    q, k, v = grouped.split([group, 1, 1], dim=1)
    return q.flatten(0, 2), k.flatten(0, 2), v.flatten(0, 2)


def internlm2_to_llama(weights: Iterable[tuple[str, torch.Tensor]],
                       config: PretrainedConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """InternLM2 checkpoint names (``model.*``, ``output.*``) as Llama's, ``wqkv`` split."""
    for name, tensor in weights:
        if ".attention.wqkv." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), split_wqkv(tensor, config)):
                yield name.replace(".attention.wqkv.", f".self_attn.{part}."), piece
            continue
        if name.startswith("output."):
            name = "lm_head." + name.removeprefix("output.")
        for old, new in _RENAMES:
            name = name.replace(old, new)
        yield name, tensor


class InternLM2ForCausalLM(LlamaForCausalLM):
    """InternLM2 decoder with an LM head (``output``).

    Args:
        config: an ``InternLM2Config`` (`ferrollm.config.remote_configs`).
        dtype: parameter and activation dtype.
    """

    @classmethod
    def layer_options(cls, config: PretrainedConfig, layer_idx: int) -> LayerOptions:
        opts = super().layer_options(config, layer_idx)
        bias = bool(getattr(config, "bias", True))
        rope = opts.rope
        if rope.get("rope_type") == "dynamic":
            # Dynamic NTK rescales only past max_position_embeddings, which no position reaches.
            rope = {"rope_type": "default", "rope_theta": rope["rope_theta"]}
        return replace(opts, rope=rope, qkv_bias=bias, o_bias=bias, mlp_bias=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Loads InternLM2-named tensors (see :func:`internlm2_to_llama`); returns the names of
        the parameters loaded."""
        return super().load_weights(internlm2_to_llama(weights, self.config))
