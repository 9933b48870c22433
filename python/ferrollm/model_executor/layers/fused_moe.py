"""Routed mixture-of-experts with every expert's weights stacked in one tensor per layer.

Each token goes to its ``top_k`` experts. Rather than looping over tokens, the step's
(token, expert) assignments are sorted by expert once, so every expert's tokens sit in one
contiguous slice: one gathered matmul pair per expert that has tokens, then one weighted
``index_add_`` scatters the results back. The work is a loop over experts, never over tokens.

Tensor parallelism splits each expert's intermediate dimension over the ranks (as the dense MLP's
gate/up and down are split), so each rank computes a partial sum of every token's output and one
all-reduce completes it.

Weights: ``w13_weight [num_experts, 2 * intermediate_per_rank, hidden]`` (gate rows, then up rows)
and ``w2_weight [num_experts, hidden, intermediate_per_rank]``. Checkpoints store one tensor per
expert and projection; :func:`expert_params_mapping` names them for ``load_weights_into``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from ferrollm.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    tensor_model_parallel_all_reduce,
)
from ferrollm.model_executor.layers.linear import divide
from ferrollm.model_executor.weight_utils import check_shape, copy_weight

__all__ = [
    "FusedMoE",
    "expert_params_mapping",
    "fused_moe",
    "select_experts",
    "unstack_expert_weights",
]


def select_experts(router_logits: torch.Tensor, top_k: int,
                   renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax routing: each token's ``top_k`` most probable experts and their weights.

    Args:
        router_logits: ``[num_tokens, num_experts]``.
        top_k: experts per token.
        renormalize: rescale the chosen probabilities to sum to 1 (Mixtral always;
            Qwen2-MoE when ``norm_topk_prob``).

    Returns:
        ``(topk_weights float32 [num_tokens, top_k], topk_ids int64 [num_tokens, top_k])``.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    topk_weights, topk_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def fused_moe(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x_t)`` for every token ``t``.

    An expert is ``down(silu(gate(x)) * up(x))``.

    Args:
        hidden_states: ``[num_tokens, hidden]``.
        w13: ``[num_experts, 2 * intermediate, hidden]``, gate rows then up rows.
        w2: ``[num_experts, hidden, intermediate]``.
        topk_weights: ``[num_tokens, top_k]`` routing weights.
        topk_ids: ``[num_tokens, top_k]`` expert ids.

    Returns:
        ``[num_tokens, hidden]`` in ``hidden_states``' dtype; the weighted sum is accumulated in
        float32.
    """
    num_tokens, top_k = topk_ids.shape
    flat_ids = topk_ids.flatten()
    # Assignment j of the sorted order is (token order[j] // top_k, expert flat_ids[order[j]]).
    order = torch.argsort(flat_ids, stable=True)
    token_idx = order // top_k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()  # one host sync per layer
    x = hidden_states[token_idx]
    expert_out = torch.empty_like(x)
    start = 0
    for expert, count in enumerate(counts):
        if count:
            end = start + count
            gate, up = F.linear(x[start:end], w13[expert]).chunk(2, dim=-1)
            expert_out[start:end] = F.linear(F.silu(gate) * up, w2[expert])
            start = end
    weighted = expert_out.float() * topk_weights.flatten()[order, None].float()
    out = torch.zeros(num_tokens, hidden_states.shape[-1], dtype=torch.float32,
                      device=hidden_states.device)
    return out.index_add_(0, token_idx, weighted).to(hidden_states.dtype)


class FusedMoE(nn.Module):
    """The routed experts of one layer: routing, the grouped expert MLPs and the TP reduction.

    Args:
        num_experts: experts in the layer.
        top_k: experts per token.
        hidden_size: model hidden size.
        intermediate_size: one expert's intermediate size (full, before TP splitting).
        renormalize: whether the chosen routing probabilities are rescaled to sum to 1.
        reduce_results: all-reduce the output (turn off when the caller adds other partial sums,
            e.g. a shared expert, before one reduction of its own).
        params_dtype: parameter dtype.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, reduce_results: bool = True,
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.reduce_results = reduce_results
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size,
                                                      "moe intermediate size")
        size = self.intermediate_size_per_partition
        self.w13_weight = self._param((num_experts, 2 * size, hidden_size), params_dtype)
        self.w2_weight = self._param((num_experts, hidden_size, size), params_dtype)

    def _param(self, shape: tuple[int, ...], dtype: torch.dtype | None) -> nn.Parameter:
        param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        param.weight_loader = self.weight_loader
        return param

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: tuple[str, int]) -> None:
        """Copies this rank's slice of one expert's projection into the stacked weight.

        Args:
            param: ``w13_weight`` or ``w2_weight``.
            loaded_weight: the checkpoint tensor: ``[intermediate, hidden]`` for gate and up,
                ``[hidden, intermediate]`` for down.
            shard_id: ``(projection, expert)`` with projection ``"gate"``, ``"up"`` or ``"down"``.
        """
        projection, expert = shard_id
        what = f"expert {expert} {projection} projection"
        size = self.intermediate_size_per_partition
        start = self.tp_rank * size
        if projection == "down":
            check_shape((self.hidden_size, self.intermediate_size), loaded_weight, what)
            copy_weight(param.data[expert], loaded_weight.narrow(1, start, size), what)
            return
        check_shape((self.intermediate_size, self.hidden_size), loaded_weight, what)
        offset = 0 if projection == "gate" else size
        copy_weight(param.data[expert].narrow(0, offset, size),
                    loaded_weight.narrow(0, start, size), what)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """Routes ``[num_tokens, hidden]`` by ``router_logits [num_tokens, num_experts]``."""
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_moe(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids)
        return tensor_model_parallel_all_reduce(out) if self.reduce_results else out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, renormalize={self.renormalize}, "
                f"tp={self.tp_rank}/{self.tp_size}")


def expert_params_mapping(num_experts: int, gate_name: str, up_name: str,
                          down_name: str) -> list[tuple[str, str, tuple[str, int]]]:
    """``load_weights_into`` entries sending each checkpoint expert tensor to its stacked slot.

    Args:
        num_experts: experts per layer.
        gate_name, up_name, down_name: the checkpoint's projection names, e.g. ``w1``, ``w3``,
            ``w2`` (Mixtral) or ``gate_proj``, ``up_proj``, ``down_proj`` (Qwen2-MoE).

    Returns:
        ``(fused parameter, checkpoint part, (projection, expert))`` triples; list them before
        any dense mapping whose part (e.g. ``.gate_proj``) they contain.
    """
    projections = (("gate", gate_name, "w13"), ("up", up_name, "w13"), ("down", down_name, "w2"))
    return [(f".experts.{param}_weight", f".experts.{expert}.{name}.weight", (projection, expert))
            for expert in range(num_experts) for projection, name, param in projections]


def unstack_expert_weights(weights: Iterable[tuple[str, torch.Tensor]], gate_name: str,
                           up_name: str, down_name: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Splits expert tensors stored stacked into one tensor per expert and projection.

    transformers >= 5 holds experts as ``experts.gate_up_proj [E, 2I, H]`` and
    ``experts.down_proj [E, H, I]``; its ``save_pretrained`` writes them per expert again, but a
    checkpoint saved from the state dict keeps them stacked. Other tensors pass through.

    Args:
        weights: ``(name, tensor)`` pairs.
        gate_name, up_name, down_name: the per-expert names to produce (see
            :func:`expert_params_mapping`).

    Yields:
        ``(name, tensor)`` with stacked expert tensors replaced by per-expert views.
    """
    for name, tensor in weights:
        stem, _, leaf = name.rpartition(".")
        if not stem.endswith(".experts") or leaf not in ("gate_up_proj", "down_proj"):
            yield name, tensor
            continue
        if leaf == "down_proj":
            for expert, down in enumerate(tensor):
                yield f"{stem}.{expert}.{down_name}.weight", down
            continue
        for expert, gate_up in enumerate(tensor):
            gate, up = gate_up.chunk(2, dim=0)
            yield f"{stem}.{expert}.{gate_name}.weight", gate
            yield f"{stem}.{expert}.{up_name}.weight", up
