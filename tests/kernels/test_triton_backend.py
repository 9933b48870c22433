"""The Triton attention backend against the torch one on the steps the Rust core schedules, the
backend selector, and a tiny model whose Attention layers run the Triton kernels (all under
Triton's interpreter on the CPU)."""

from __future__ import annotations

import helpers.triton_interpret  # noqa: F401  (must come before ferrollm.kernels.triton)
import numpy as np
import pytest
import torch
from conftest import next_tokens
from helpers.engine_driver import build_checkpoint, load_ferrollm_model, make_prompts, run_engine

from ferrollm import EngineCore, SamplingOptions
from ferrollm.attention import cpu_backend, triton_backend
from ferrollm.attention.backend import AttentionMetadata, allocate_kv_cache
from ferrollm.attention.selector import BACKEND_ENV, get_attn_backend
from ferrollm.exceptions import ConfigError

torch.set_num_threads(1)

BLOCK_SIZE, NUM_BLOCKS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 16, 48, 4, 2, 16


def test_selector_picks_triton_for_cuda_and_torch_for_cpu(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert get_attn_backend("cpu") is cpu_backend
    assert get_attn_backend(torch.device("cuda", 0)) is triton_backend
    assert get_attn_backend("cuda").NAME == "TRITON" and get_attn_backend("cpu").NAME == "TORCH"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert get_attn_backend("cuda") is cpu_backend
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ConfigError, match=f"{BACKEND_ENV}.*'FLASH'"):
        get_attn_backend("cpu")


class StepCounts:
    def __init__(self):
        self.prefix_hits = self.mid_block_chunks = self.decode_only = self.mixed = 0

    def add(self, step, meta):
        query_lens = np.diff(step.query_start_loc)
        computed = step.num_computed_tokens
        self.prefix_hits += int(((computed > 0) & (computed % BLOCK_SIZE == 0) & (query_lens > 1)).any())
        self.mid_block_chunks += int(((computed % BLOCK_SIZE != 0) & (query_lens > 1)).any())
        self.decode_only += int(meta.is_decode_only)
        self.mixed += int((query_lens == 1).any() and (query_lens > 1).any())


@pytest.mark.parametrize("dtype,window,cap", [(torch.float32, None, None), (torch.float32, 24, 3.0),
                                              (torch.bfloat16, None, None)])
def test_matches_torch_backend_on_engine_core_steps(dtype, window, cap):
    core = EngineCore(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS, max_model_len=128, max_num_seqs=4,
                      max_num_batched_tokens=40, sliding_window=window)
    params = SamplingOptions(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(4, seed=0, vocab=300, min_len=20, max_len=38, prefix=list(range(3, 35)))
    # Request 0 runs alone first, so the others find its two full prefix blocks cached.
    core.add_requests(["0"], [prompts[0]], [params])
    pending = [(str(i), p) for i, p in enumerate(prompts) if i]
    cache_triton, cache_torch = (allocate_kv_cache(1, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype)[0]
                                 for _ in range(2))
    gen = torch.Generator().manual_seed(0)
    counts = StepCounts()
    while core.has_unfinished_requests():
        step = core.schedule()
        meta = AttentionMetadata.from_step(step, BLOCK_SIZE)
        if meta.num_tokens:
            counts.add(step, meta)
            query = torch.randn(meta.num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
            key, value = (torch.randn(meta.num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
                          for _ in range(2))
            triton_backend.write_kv(key, value, cache_triton, meta.slot_mapping)
            cpu_backend.write_kv(key, value, cache_torch, meta.slot_mapping)
            assert torch.equal(cache_triton, cache_torch)
            out = triton_backend.paged_attention(query, cache_triton, meta, HEAD_DIM**-0.5, window, cap)
            ref = cpu_backend.paged_attention(query, cache_torch, meta, HEAD_DIM**-0.5, window, cap)
            tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
            torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        core.update(next_tokens(step) if len(step) else np.zeros(0, dtype=np.int64))
        if pending:
            core.add_requests([i for i, _ in pending], [p for _, p in pending], [params] * len(pending))
            pending = []
    assert counts.prefix_hits and counts.mid_block_chunks and counts.decode_only and counts.mixed, vars(counts)


@pytest.mark.parametrize("kind", ["llama", "qwen2_sliding"])
def test_tiny_model_through_the_triton_backend(kind, tmp_path, monkeypatch):
    build_checkpoint(kind, tmp_path)
    model = load_ferrollm_model(tmp_path)
    prompts = make_prompts(4, seed=1, vocab=384, min_len=5, max_len=30, prefix=list(range(3, 19)))
    engine = dict(max_num_batched_tokens=24, max_num_seqs=4, first_alone=True)
    monkeypatch.setenv(BACKEND_ENV, "TORCH")
    ref = run_engine(model, prompts, 4, **engine)
    monkeypatch.setenv(BACKEND_ENV, "TRITON")
    calls = []
    kernel = triton_backend.paged_attention
    monkeypatch.setattr(triton_backend, "paged_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    run = run_engine(model, prompts, 4, **engine)
    assert len(calls) == 2 * run.num_steps  # two layers, every step
    assert run.tokens == ref.tokens
    for i in ref.logits:
        torch.testing.assert_close(torch.stack(run.logits[i]), torch.stack(ref.logits[i]), atol=1e-4, rtol=0)
    assert run.num_chunked_steps and run.stats["prefix_cache_hit_tokens"] >= 3 * 16
