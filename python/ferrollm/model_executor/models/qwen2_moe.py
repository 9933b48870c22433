"""Qwen2-MoE: Mixtral's layout with q/k/v biases, a shared expert beside the routed ones, and
dense MLP layers mixed in.

A layer is sparse unless it is listed in ``mlp_only_layers`` or ``(layer + 1)`` is not a multiple
of ``decoder_sparse_step``; dense layers use the Llama MLP with ``intermediate_size``. The router
keeps the top-k softmax probabilities as they are unless ``norm_topk_prob``. The shared expert's
output is scaled by ``sigmoid(shared_expert_gate(x))`` and added to the routed experts'.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from ferrollm.distributed import tensor_model_parallel_all_reduce
from ferrollm.model_executor.layers.fused_moe import FusedMoE
from ferrollm.model_executor.layers.linear import ReplicatedLinear
from ferrollm.model_executor.models.llama import LlamaMLP
from ferrollm.model_executor.models.mixtral import MixtralForCausalLM, check_silu
from ferrollm.model_executor.models.qwen2 import qwen_sliding_window

__all__ = ["Qwen2MoeForCausalLM"]


class Qwen2MoeSparseMoeBlock(nn.Module):
    """Routed experts plus the gated shared expert, reduced over the ranks once."""

    def __init__(self, config: PretrainedConfig, dtype: torch.dtype):
        super().__init__()
        check_silu(config)
        hidden = config.hidden_size
        self.gate = ReplicatedLinear(hidden, config.num_experts, bias=False, params_dtype=dtype)
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, hidden,
                                config.moe_intermediate_size, renormalize=config.norm_topk_prob,
                                reduce_results=False, params_dtype=dtype)
        self.shared_expert = LlamaMLP(hidden, config.shared_expert_intermediate_size, "silu",
                                      False, dtype)
        # Both branches are partial sums over the intermediate split; one all-reduce below.
        self.shared_expert.down_proj.reduce_results = False
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False, params_dtype=dtype)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        routed = self.experts(hidden_states, self.gate(hidden_states))
        shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return tensor_model_parallel_all_reduce(routed + shared)


def is_sparse_layer(config: PretrainedConfig, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` has routed experts (HF's rule)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0
            and (layer_idx + 1) % config.decoder_sparse_step == 0)


class Qwen2MoeForCausalLM(MixtralForCausalLM):
    """Qwen2-MoE decoder with an LM head.

    Args:
        config: the HF ``Qwen2MoeConfig``.
        dtype: parameter and activation dtype.
    """

    expert_names = ("gate_proj", "up_proj", "down_proj")
    checkpoint_renames = ()

    @staticmethod
    def _num_experts(config: PretrainedConfig) -> int:
        return config.num_experts

    @staticmethod
    def _mlp(config: PretrainedConfig, dtype: torch.dtype, layer_idx: int) -> nn.Module:
        if is_sparse_layer(config, layer_idx):
            return Qwen2MoeSparseMoeBlock(config, dtype)
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, False, dtype)

    @staticmethod
    def _qkv_bias(config: PretrainedConfig) -> bool:
        return bool(getattr(config, "qkv_bias", True))

    @staticmethod
    def _sliding_window(config: PretrainedConfig, layer_idx: int) -> int | None:
        return qwen_sliding_window(config, layer_idx)
