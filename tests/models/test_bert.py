"""BERT's layers against transformers: bidirectional attention over ragged batches, the pooling
methods and heads, and loading `BertModel` and `BertForMaskedLM` checkpoints."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers.checkpoints import build_bert

from ferrollm.attention.backend import AttentionMetadata
from ferrollm.attention.encoder import EncoderAttention, EncoderBatch
from ferrollm.exceptions import UnsupportedModelError
from ferrollm.model_executor.layers.pooler import Pooler, pool_sequences
from ferrollm.model_executor.loader import get_model, iterate_safetensors
from ferrollm.model_executor.models.bert import BertModel
from ferrollm.pooling_params import PoolingParams

LENGTHS = [5, 1, 12, 7]


class Step:
    """The attention arrays of a step holding whole prompts of the given lengths."""

    def __init__(self, lengths: list[int]):
        self.query_start_loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        self.seq_lens = np.array(lengths, dtype=np.int32)
        self.num_computed_tokens = np.zeros(len(lengths), dtype=np.int32)
        self.slot_mapping = np.zeros(sum(lengths), dtype=np.int64)
        self.block_tables = np.zeros((len(lengths), 1), dtype=np.int32)


def meta(lengths: list[int]) -> AttentionMetadata:
    return AttentionMetadata.from_step(Step(lengths), block_size=16)


def test_encoder_attention_sees_every_token_of_its_own_prompt_only():
    torch.manual_seed(0)
    heads, dim = 4, 8
    q, k, v = (torch.randn(sum(LENGTHS), heads * dim) for _ in range(3))
    out = EncoderAttention(heads, dim, dim**-0.5)(q, k, v, EncoderBatch.from_metadata(meta(LENGTHS)))
    start = 0
    for n in LENGTHS:
        def split(x):
            return x[start:start + n].view(n, heads, dim).transpose(0, 1)
        ref = F.scaled_dot_product_attention(split(q), split(k), split(v))  # no mask: bidirectional
        assert torch.allclose(out[start:start + n], ref.transpose(0, 1).reshape(n, -1), atol=1e-5)
        start += n


def test_sequence_pooling_methods():
    torch.manual_seed(0)
    hidden = torch.randn(sum(LENGTHS), 6)
    loc = meta(LENGTHS).query_start_loc
    bounds = loc.tolist()
    pieces = [hidden[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    assert torch.equal(pool_sequences(hidden, loc, "CLS"), torch.stack([p[0] for p in pieces]))
    assert torch.equal(pool_sequences(hidden, loc, "LAST"), torch.stack([p[-1] for p in pieces]))
    assert torch.allclose(pool_sequences(hidden, loc, "MEAN"), torch.stack([p.mean(0) for p in pieces]), atol=1e-6)


def test_pooler_applies_each_requests_head_and_task():
    torch.manual_seed(0)
    hidden = torch.randn(sum(LENGTHS), 6)
    loc = meta(LENGTHS).query_start_loc
    params = [PoolingParams(task="embed", normalize=True), PoolingParams(task="embed", normalize=False, dimensions=3),
              PoolingParams(task="token_embed", normalize=True), PoolingParams(task="embed", normalize=True)]
    out = Pooler("MEAN")(hidden, loc, params)
    means = pool_sequences(hidden, loc, "MEAN")
    assert torch.allclose(out[0], F.normalize(means[0], dim=-1), atol=1e-6)
    assert torch.allclose(out[1], means[1, :3], atol=1e-6)
    assert out[2].shape == (12, 6) and torch.allclose(out[2], F.normalize(hidden[6:18], dim=-1), atol=1e-6)
    assert torch.allclose(out[3], F.normalize(means[3], dim=-1), atol=1e-6)


@pytest.mark.parametrize("masked_lm", [False, True], ids=["BertModel", "BertForMaskedLM"])
def test_bert_matches_transformers_on_a_ragged_batch(tmp_path, masked_lm):
    hf_model = build_bert(tmp_path, masked_lm=masked_lm)
    encoder = hf_model.bert if masked_lm else hf_model
    config = transformers.AutoConfig.from_pretrained(tmp_path)
    model = get_model(config, torch.float32, iterate_safetensors(tmp_path))
    assert isinstance(model, BertModel)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in LENGTHS]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])
    with torch.no_grad():
        ours = model(torch.cat(prompts), positions, [], meta(LENGTHS))
        refs = [encoder(p[None]).last_hidden_state[0] for p in prompts]
    assert torch.allclose(ours, torch.cat(refs), atol=1e-5)


def test_unsupported_bert_options_are_named():
    config = transformers.BertConfig(hidden_size=16, num_attention_heads=2, num_hidden_layers=1,
                                     intermediate_size=32, hidden_act="silu")
    with pytest.raises(UnsupportedModelError, match="hidden_act 'silu'"):
        BertModel(config)
