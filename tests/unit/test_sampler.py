"""The batched sampler: greedy, filters, penalties, masks, seeded draws and logprobs."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import ferrollm
from ferrollm.exceptions import KernelError
from ferrollm.model_executor import sampling_ops as ops
from ferrollm.model_executor.sampler import Sampler, compute_prompt_logprobs
from ferrollm.model_executor.sampling_metadata import SamplingMetadata, make_generator

torch.set_num_threads(2)

NEG_INF = float("-inf")


def make_meta(num_reqs: int, vocab_size: int, **per_row) -> SamplingMetadata:
    """Metadata for `num_reqs` rows; scalar or per-row values override the defaults."""
    arrays = {
        "temperature": (1.0, np.float32), "top_p": (1.0, np.float32), "top_k": (0, np.int32),
        "min_p": (0.0, np.float32), "seeds": (-1, np.int64),
        "presence_penalty": (0.0, np.float32), "frequency_penalty": (0.0, np.float32),
        "repetition_penalty": (1.0, np.float32),
    }
    kwargs: dict[str, Any] = {}
    for name, (default, dtype) in arrays.items():
        value = per_row.pop(name, default)
        kwargs[name] = np.broadcast_to(np.asarray(value, dtype=dtype), (num_reqs,)).copy()
    return SamplingMetadata.from_arrays(**kwargs, vocab_size=vocab_size, **per_row)


def sample(logits: torch.Tensor, **per_row):
    return Sampler()(logits, make_meta(logits.shape[0], logits.shape[1], **per_row))


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, 40, generator=torch.Generator().manual_seed(0)) * 3


def test_greedy_takes_the_argmax(logits):
    out = sample(logits, temperature=0.0)
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64 and out.logprobs is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_sample_is_torchs_argmax_ties_and_nans_included(dtype):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    logits[1, 5] = logits[1, 250] = 50.0  # a tie: the first wins
    logits[2, 7] = logits[2, 9] = float("nan")  # NaN counts as the largest: the first NaN
    logits = logits.to(dtype)
    for view in (logits, logits[:, ::3], logits.T.contiguous().T):
        got = ops.greedy_sample(view)
        assert got.dtype == torch.int64 and torch.equal(got, view.argmax(dim=-1))
    assert ops.greedy_sample(logits).tolist()[1:3] == [5, 7]


def test_greedy_rows_stay_greedy_in_a_mixed_batch(logits):
    temps = np.array([0.0, 1.5, 0.0, 1.5, 0.0, 1.5])
    meta = make_meta(6, 40, temperature=temps, top_k=5)
    assert not meta.all_greedy and not meta.all_random
    for _ in range(5):
        out = Sampler()(logits, meta)
        greedy_rows = [0, 2, 4]
        assert torch.equal(out.sampled_token_ids[greedy_rows], logits[greedy_rows].argmax(-1))


def test_sampler_leaves_the_callers_logits_alone(logits):
    before = logits.clone()
    sample(logits, temperature=0.5, top_p=0.5, presence_penalty=1.0,
           prompt_token_ids=[[1]] * 6, output_token_ids=[[2]] * 6)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("per_row, edits", [
    ({}, False),  # plain sampling at temperature 1: nothing in place, no private copy
    ({"temperature": 0.0}, False),
    ({"top_k": 3, "top_p": 0.9, "min_p": 0.1}, False),  # the filters return new tensors
    ({"temperature": 0.7}, True),
    ({"temperature": np.array([0.0, 1.0, 1.0, 1.0, 1.0, 1.0])}, True),  # greedy rows divide by 1
    ({"logit_bias": [{3: 1.0}] + [None] * 5}, True),
    ({"presence_penalty": 1.0, "prompt_token_ids": [[1]] * 6, "output_token_ids": [[2]] * 6}, True),
])
def test_the_sampler_copies_the_logits_only_where_a_stage_edits_them(logits, per_row, edits):
    meta = make_meta(6, 40, **per_row)
    assert meta.edits_logits == edits
    before = logits.clone()
    for _ in range(3):
        Sampler()(logits, meta)
    assert torch.equal(logits, before)


@pytest.mark.parametrize("filters", [{"top_k": 1}, {"top_p": 1e-6}, {"top_k": 1, "top_p": 0.5},
                                     {"min_p": 1.0}])
def test_filters_that_keep_one_token_are_greedy(logits, filters):
    for _ in range(5):
        out = sample(logits, temperature=2.0, **filters)
        assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))


def test_top_k_and_top_p_keep_the_expected_sets():
    probs = torch.tensor([[0.1, 0.4, 0.2, 0.3]] * 4)
    logits = probs.log()
    k = torch.tensor([2, 0, 0, 3])
    p = torch.tensor([1.0, 0.65, 1.0, 0.65])
    kept = ops.apply_top_k_top_p(logits, k, 3, p).isfinite()
    expected = torch.tensor([
        [False, True, False, True],  # top-2
        [False, True, False, True],  # 0.4 + 0.3 reach 0.65
        [True, True, True, True],  # both off
        [False, True, False, True],  # top-3 renormalised, then 0.65 of it
    ])
    assert torch.equal(kept, expected)
    # Top-k alone takes the topk path; ties with the k-th value are kept, as in vLLM.
    tied = torch.tensor([[1.0, 3.0, 2.0, 2.0]])
    assert ops.apply_top_k_top_p(tied, torch.tensor([2]), 2, None).isfinite().tolist() == \
        [[False, True, True, True]]


def test_min_p_drops_tokens_below_the_scaled_maximum():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05]]).log()
    kept = ops.apply_min_p(logits, torch.tensor([0.5, 0.0])).isfinite()
    assert kept.tolist() == [[True, True, False, False], [True] * 4]
    draws = sample(logits[:1].expand(4000, 4), min_p=0.5).sampled_token_ids
    assert set(draws.tolist()) == {0, 1}


def test_penalties_match_a_hand_computed_example():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [2.0, -1.0, 0.5, 3.0, -2.0]])
    meta = make_meta(2, 5, temperature=0.0,
                     repetition_penalty=np.array([2.0, 1.0]),
                     frequency_penalty=np.array([0.5, 0.0]),
                     presence_penalty=np.array([0.25, 0.0]),
                     prompt_token_ids=[[0, 4], [0, 4]], output_token_ids=[[3, 3, 1], []])
    processed = logits.clone()
    Sampler._process_logits_(processed, meta)
    # Seen: 0, 4 (prompt), 3 twice and 1 once (output). Repetition divides positives and
    # multiplies negatives; frequency takes 0.5 per occurrence, presence 0.25 once.
    expected = torch.tensor([1.0, -2.0 - 0.5 - 0.25, 0.5, 1.5 - 1.0 - 0.25, -4.0])
    torch.testing.assert_close(processed[0], expected)
    torch.testing.assert_close(processed[1], logits[1])  # no penalty on this row
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [0, 3]


def test_logit_bias_can_force_a_token(logits):
    bias = [{7: 100.0}, None, {3: 100.0, 8: -100.0}, None, {0: 50.0, 1: 60.0}, None]
    for temperature in (0.0, 1.0):
        out = sample(logits, temperature=temperature, logit_bias=bias)
        assert out.sampled_token_ids[[0, 2, 4]].tolist() == [7, 3, 1]


def test_allowed_token_ids_restrict_the_draw():
    logits = torch.zeros(3000, 10)
    allowed = [[3, 5] if i % 2 == 0 else None for i in range(3000)]
    draws = sample(logits, allowed_token_ids=allowed).sampled_token_ids
    assert set(draws[0::2].tolist()) == {3, 5}
    assert len(set(draws[1::2].tolist())) == 10
    greedy = sample(torch.arange(10.0).expand(2, 10), temperature=0.0,
                    allowed_token_ids=[[2, 4], None]).sampled_token_ids
    assert greedy.tolist() == [4, 9]


def test_min_tokens_blocks_stop_tokens():
    logits = torch.tensor([[0.0, 1.0, 9.0, 2.0]] * 2)
    out = sample(logits, temperature=0.0, min_tokens_stop_ids=[[2], None])
    assert out.sampled_token_ids.tolist() == [3, 2]


def _run_seeded(batch_rows: list[int | None], steps: int, target: int) -> list[int]:
    """Samples `steps` tokens for a batch whose row `target` has seed 1234."""
    vocab = 64
    seeds = np.array([-1 if s is None else s for s in batch_rows])
    gens = {i: make_generator(int(s)) for i, s in enumerate(seeds) if s != -1}
    tokens = []
    for step in range(steps):
        logits = torch.randn(len(batch_rows), vocab,
                             generator=torch.Generator().manual_seed(step))
        logits[target] = torch.linspace(0, 1, vocab)  # the seeded request's own model output
        out = Sampler()(logits, make_meta(len(batch_rows), vocab, seeds=seeds,
                                          generators=gens))
        tokens.append(int(out.sampled_token_ids[target]))
    return tokens


def test_seeded_rows_are_reproducible_and_batch_independent():
    alone = _run_seeded([1234], steps=12, target=0)
    assert _run_seeded([1234], steps=12, target=0) == alone
    torch.manual_seed(99)  # the unseeded rows' draws must not matter
    crowded = _run_seeded([None, 7, 1234, None, 5], steps=12, target=2)
    assert crowded == alone
    assert _run_seeded([4321], steps=12, target=0) != alone


def test_a_seeded_row_without_a_generator_is_refused():
    with pytest.raises(ValueError, match=r"seeded rows \[1\] have no generator"):
        make_meta(2, 8, seeds=np.array([-1, 3]))
    make_meta(2, 8, seeds=np.array([-1, 3]), temperature=0.0)  # greedy: no generator needed


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_draws_follow_the_tempered_softmax(temperature):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    num = 20_000
    torch.manual_seed(1)
    draws = sample(probs.log().expand(num, 4), temperature=temperature).sampled_token_ids
    expected = probs ** (1 / temperature)
    expected = expected / expected.sum() * num
    observed = torch.bincount(draws, minlength=4).float()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (observed, expected)  # 3 degrees of freedom, p = 0.001


def test_cpu_draws_across_blocks_follow_the_distribution_and_skip_masked_tokens():
    # 700 tokens: two whole blocks of the two-level search and a short last one; every other
    # token masked, mass spread so that each block (the last included) is drawn from.
    vocab, num = 700, 30_000
    logits = torch.full((vocab,), NEG_INF)
    logits[::2] = torch.linspace(0.0, 2.0, vocab // 2)
    torch.manual_seed(2)
    draws = sample(logits.expand(num, vocab)).sampled_token_ids
    assert bool((draws % 2 == 0).all()), "a masked token was drawn"
    # Compare counts over 10 equal slices of the vocabulary (chi-square, 9 dof, p = 0.001).
    probs = logits.softmax(dim=-1)
    expected = probs.view(10, -1).sum(dim=1) * num
    observed = torch.bincount(draws // (vocab // 10), minlength=10).float()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 27.88, (observed, expected)


def test_the_cpu_kernel_draws_what_the_torch_search_draws_from_the_same_numbers():
    # Both invert the row's cumulative distribution at one seeded uniform number per row: the
    # kernel from the logits, torch's two-level search from the softmax (the GPU-less fallback).
    logits = torch.randn(8, 5000, generator=torch.Generator().manual_seed(4)) * 3
    logits[:, 1::3] = NEG_INF
    gens = lambda: {r: make_generator(100 + r) for r in range(8)}  # noqa: E731
    kernel = ops.sample_logits(logits, gens())
    search = ops.random_sample(logits.softmax(dim=-1), gens())
    assert kernel.dtype == torch.int64 and torch.equal(kernel, search)
    assert bool((kernel % 3 != 1).all())


def test_one_wide_row_split_over_the_team_draws_what_the_torch_search_draws():
    # Batch 1 over a Qwen2-sized vocabulary: the kernel splits the row's passes over torch's
    # OpenMP team (one thread per row otherwise), and must draw the same tokens.
    logits = torch.randn(1, 151_936, generator=torch.Generator().manual_seed(5)) * 4
    logits[:, 2::5] = NEG_INF
    for seed in range(20):
        kernel = ops.sample_logits(logits, {0: make_generator(seed)})
        assert torch.equal(kernel, ops.random_sample(logits.softmax(dim=-1), {0: make_generator(seed)}))


def test_the_cpu_kernel_refuses_a_row_with_nothing_to_draw():
    logits = torch.zeros(2, 10)
    logits[1] = NEG_INF
    with pytest.raises(KernelError, match="row 1 has none"):
        ops.sample_logits(logits, {})


def test_logprobs_and_ranks_come_from_the_raw_logits(logits):
    out = sample(logits, temperature=0.7, top_k=3, presence_penalty=1.5,
                 prompt_token_ids=[[]] * 6, output_token_ids=[[1, 2]] * 6, max_num_logprobs=4)
    raw = logits.log_softmax(dim=-1)
    sampled = out.sampled_token_ids
    assert out.logprob_token_ids.shape == (6, 5) and out.logprobs.dtype == torch.float32
    assert torch.equal(out.logprob_token_ids[:, 0], sampled)
    torch.testing.assert_close(out.logprobs[:, 0], raw.gather(1, sampled[:, None]).squeeze(1))
    top = raw.topk(4, dim=-1)
    assert torch.equal(out.logprob_token_ids[:, 1:], top.indices)
    torch.testing.assert_close(out.logprobs[:, 1:], top.values)
    expected_ranks = (raw > raw.gather(1, sampled[:, None])).sum(-1) + 1
    assert torch.equal(out.sampled_token_ranks, expected_ranks)
    greedy = sample(logits, temperature=0.0, max_num_logprobs=0)
    assert greedy.logprobs.shape == (6, 1) and greedy.sampled_token_ranks.eq(1).all()


def test_prompt_logprobs(logits):
    targets = torch.tensor([3, 0, 39, 5, 5, 1])
    ids, values, ranks = compute_prompt_logprobs(logits, targets, 2)
    raw = logits.log_softmax(dim=-1)
    assert torch.equal(ids[:, 0], targets) and ids.shape == (6, 3)
    torch.testing.assert_close(values[:, 0], raw[torch.arange(6), targets])
    assert torch.equal(ranks, (raw > raw[torch.arange(6), targets][:, None]).sum(-1) + 1)
    everything = compute_prompt_logprobs(logits, targets, -1)
    assert everything.logprobs.shape == (6, 41)


def test_metadata_reads_the_core_step_arrays():
    engine = ferrollm.EngineCore(block_size=16, num_blocks=16, max_model_len=64)
    params = [ferrollm.SamplingParams(temperature=0.0),
              ferrollm.SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=3)]
    engine.add_requests(["a", "b"], [[5, 6], [7, 8, 9]], [p.to_core() for p in params])
    step = engine.schedule()
    meta = SamplingMetadata.from_scheduler_output(step, vocab_size=32,
                                                  generators={1: make_generator(3)})
    assert meta.top_k.tolist() == [0, 5] and meta.max_top_k == 5  # greedy row: filters off
    assert meta.no_penalties and meta.no_min_p and not meta.no_top_p
    out = Sampler()(torch.randn(2, 32), meta)
    assert out.sampled_token_ids.shape == (2,)
