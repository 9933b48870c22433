"""Layers: tensor-parallel weight loading (ranks simulated in one process), rotary embedding and
RMSNorm against transformers."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama import modeling_llama

from ferrollm.distributed import init_tensor_model_parallel
from ferrollm.exceptions import CheckpointError, ConfigError, UnsupportedModelError
from ferrollm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from ferrollm.model_executor.layers.norm import RMSNorm
from ferrollm.model_executor.layers.rotary import RotaryEmbedding, get_rope, rope_parameters
from ferrollm.model_executor.layers.vocab import ParallelLMHead, VocabParallelEmbedding

torch.set_num_threads(2)


@pytest.fixture
def set_tp():
    """Pretends to be rank ``r`` of ``n``: layers build and load their shard; forwards that would
    communicate are not called."""
    yield init_tensor_model_parallel
    init_tensor_model_parallel(0, 1)


def load(layer, **tensors):
    """Loads full tensors by parameter name; ``name=(tensor, shard_id)`` for fused layers."""
    params = dict(layer.named_parameters())
    for name, value in tensors.items():
        param_name, *shard = name.split("__")
        tensor, shard_id = value if isinstance(value, tuple) else (value, None)
        param = params[param_name]
        if shard_id is None:
            param.weight_loader(param, tensor)
        else:
            param.weight_loader(param, tensor, shard_id)


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_qkv_shards_by_head_and_replicates_kv_heads(set_tp, tp_size):
    hidden, head, heads, kv_heads = 8, 2, 4, 2
    w = {s: torch.randn(n * head, hidden) for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    b = {s: torch.randn(len(t)) for s, t in w.items()}
    x = torch.randn(3, hidden)
    full = {s: F.linear(x, w[s], b[s]) for s in w}
    q_parts = []
    for rank in range(tp_size):
        set_tp(rank, tp_size)
        layer = QKVParallelLinear(hidden, head, heads, kv_heads, bias=True)
        for s in w:
            load(layer, **{f"weight__{s}": (w[s], s), f"bias__{s}": (b[s], s)})
        q, k, v = layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
        q_parts.append(q)
        kv_index = rank // layer.num_kv_head_replicas
        cols = slice(kv_index * layer.kv_size, (kv_index + 1) * layer.kv_size)
        torch.testing.assert_close(k, full["k"][:, cols])
        torch.testing.assert_close(v, full["v"][:, cols])
    torch.testing.assert_close(torch.cat(q_parts, dim=-1), full["q"])
    assert layer.num_kv_head_replicas == max(1, tp_size // kv_heads)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_gate_up_and_down_shards_reassemble(set_tp, tp_size):
    hidden, inter = 6, 8
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    down_bias = torch.randn(hidden)
    x = torch.randn(3, hidden)
    gates, ups, partial_sums = [], [], torch.zeros(3, hidden)
    for rank in range(tp_size):
        set_tp(rank, tp_size)
        gate_up = MergedColumnParallelLinear(hidden, [inter, inter], bias=False)
        load(gate_up, weight__0=(gate, 0), weight__1=(up, 1))
        g, u = gate_up(x).chunk(2, dim=-1)
        gates.append(g)
        ups.append(u)
        down_proj = RowParallelLinear(inter, hidden, bias=True, reduce_results=False)
        load(down_proj, weight=down, bias=down_bias)
        # Rank r's row-parallel input is its slice of the features, here the gate activations.
        partial_sums += down_proj(g)
    torch.testing.assert_close(torch.cat(gates, -1), x @ gate.T)
    torch.testing.assert_close(torch.cat(ups, -1), x @ up.T)
    # Summing the ranks' partial products (what the all-reduce does) gives the full layer,
    # with the bias counted once.
    torch.testing.assert_close(partial_sums, torch.cat(gates, -1) @ down.T + down_bias)


def test_column_parallel_loads_its_rows(set_tp):
    weight = torch.arange(24.0).reshape(6, 4)
    set_tp(1, 3)
    layer = ColumnParallelLinear(4, 6, bias=False)
    load(layer, weight=weight)
    assert torch.equal(layer.weight, weight[2:4])


def test_uneven_split_is_a_config_error(set_tp):
    set_tp(0, 3)
    with pytest.raises(ConfigError, match="num_attention_heads"):
        QKVParallelLinear(8, 2, 4, 2)


def test_shape_mismatch_names_the_tensor():
    layer = QKVParallelLinear(8, 2, 4, 2)
    with pytest.raises(CheckpointError, match="k projection"):
        load(layer, weight__k=(torch.randn(5, 8), "k"))


@pytest.mark.parametrize("tp_size", [1, 2])
def test_vocab_is_padded_per_rank_and_padding_is_zero(set_tp, tp_size):
    table = torch.randn(300, 8)
    rows = []
    for rank in range(tp_size):
        set_tp(rank, tp_size)
        embed = VocabParallelEmbedding(300, 8)
        load(embed, weight=table)
        assert embed.num_embeddings_per_partition % 64 == 0
        rows.append(embed.weight)
    padded = torch.cat(rows)
    assert torch.equal(padded[:300], table) and not padded[300:].any()


def test_lm_head_logits_drop_padding_and_tie_to_the_embedding():
    table = torch.randn(300, 8)
    embed = VocabParallelEmbedding(300, 8)
    load(embed, weight=table)
    head = ParallelLMHead(300, 8)
    head.tie_weights(embed)
    hidden = torch.randn(5, 8)
    assert torch.equal(embed(torch.tensor([3, 299])), table[[3, 299]])
    logits = head.compute_logits(hidden)
    assert logits.shape == (5, 300) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, hidden @ table.T)


ROPE_CONFIGS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
]


@pytest.mark.parametrize("rope", ROPE_CONFIGS, ids=lambda r: r["rope_type"])
def test_rotary_matches_transformers(rope):
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=512, rope_parameters=dict(rope))
    positions = torch.randint(0, 512, (7,))
    q, k = torch.randn(7, 2 * 32), torch.randn(7, 32)
    rotary = get_rope(32, 512, rope_parameters(config))
    q_out, k_out = rotary(positions, q, k)

    hf_rotary = modeling_llama.LlamaRotaryEmbedding(config)
    cos, sin = hf_rotary(q, positions[None])
    hf_q, hf_k = modeling_llama.apply_rotary_pos_emb(
        q.view(1, 7, 2, 32).transpose(1, 2), k.view(1, 7, 1, 32).transpose(1, 2), cos, sin)
    torch.testing.assert_close(q_out, hf_q.transpose(1, 2).reshape(7, 64))
    torch.testing.assert_close(k_out, hf_k.transpose(1, 2).reshape(7, 32))


@pytest.mark.parametrize("neox", [True, False])
def test_rotary_rotates_feature_pairs_by_position_angles(neox):
    head, rotary_dim, base = 8, 6, 100.0
    rotary = RotaryEmbedding(head, rotary_dim, 32, base, is_neox_style=neox)
    positions = torch.tensor([0, 5, 31])
    x = torch.randn(3, head)
    out, _ = rotary(positions, x, x.clone())
    half = rotary_dim // 2
    pairs = [(i, i + half) if neox else (2 * i, 2 * i + 1) for i in range(half)]
    for i, (a, b) in enumerate(pairs):
        angle = positions * base ** (-2 * i / rotary_dim)
        rotated = torch.complex(x[:, a], x[:, b]) * torch.exp(1j * angle)
        torch.testing.assert_close(out[:, a], rotated.real, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[:, b], rotated.imag, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[:, rotary_dim:], x[:, rotary_dim:])  # partial rotary leaves the rest


def test_unknown_rope_type_is_unsupported():
    with pytest.raises(UnsupportedModelError, match="yarn"):
        get_rope(8, 16, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})


def test_rms_norm_fuses_the_residual_add():
    norm = RMSNorm(16, eps=1e-5)
    norm.weight.copy_(torch.randn(16))
    hf_norm = modeling_llama.LlamaRMSNorm(16, eps=1e-5)
    hf_norm.weight.data.copy_(norm.weight)
    x, residual = torch.randn(4, 16), torch.randn(4, 16)
    out, new_residual = norm(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, hf_norm(x + residual))
    torch.testing.assert_close(norm(x), hf_norm(x))


@pytest.mark.parametrize("tp_size", [1, 2, 4])
def test_fused_checkpoint_tensors_are_split_before_sharding(set_tp, tp_size):
    w = {s: torch.randn(n * 2, 8) for s, n in (("q", 4), ("k", 2), ("v", 2))}
    gate, up = torch.randn(8, 6), torch.randn(8, 6)
    for rank in range(tp_size):
        set_tp(rank, tp_size)
        fused, split = QKVParallelLinear(8, 2, 4, 2), QKVParallelLinear(8, 2, 4, 2)
        load(fused, weight=torch.cat([w["q"], w["k"], w["v"]]))
        for s in w:
            load(split, **{f"weight__{s}": (w[s], s)})
        assert torch.equal(fused.weight, split.weight)
        merged, merged_split = MergedColumnParallelLinear(6, [8, 8]), MergedColumnParallelLinear(6, [8, 8])
        load(merged, weight=torch.cat([gate, up]))
        load(merged_split, weight__0=(gate, 0), weight__1=(up, 1))
        assert torch.equal(merged.weight, merged_split.weight)
