"""torch.compile at each CompilationLevel, on the CPU: tokens equal the eager model's, PIECEWISE
cuts the graph at every attention call, and the attention layers find their caches through the
forward context.

The engine compiles only on a GPU, with inductor (tests/e2e/test_gpu.py); here the same
machinery runs with the ``eager`` backend on a float64 model, whose CPU path is plain torch (the
Rust kernels take fp32 and bf16 only), so what is checked is the tracing, the cut and the
dispatch, in seconds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.engine_driver import build_checkpoint, load_ferrollm_model, make_prompts

import ferrollm
from ferrollm.attention.backend import AttentionMetadata, allocate_kv_cache
from ferrollm.attention.forward_context import set_forward_context, unified_attention
from ferrollm.attention.layer import Attention
from ferrollm.config import CompilationConfig, CompilationLevel
from ferrollm.exceptions import EngineError
from ferrollm.worker.compiler import compile_model

BLOCK, NUM_BLOCKS = 16, 64
SCRATCH_BLOCK = NUM_BLOCKS - 1  # the warm-up's writes land here (the CPU write has no skip slot)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("llama")
    build_checkpoint("llama", folder)
    return load_ferrollm_model(folder, torch.float64)


def scratch_batch(n: int):
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n) + SCRATCH_BLOCK * BLOCK, block_tables=torch.zeros(n, 8, dtype=torch.int32),
        query_start_loc=torch.arange(n + 1, dtype=torch.int32), seq_lens=torch.zeros(n, dtype=torch.int32),
        num_computed_tokens=torch.zeros(n, dtype=torch.int32), num_reqs=n, num_tokens=n, max_query_len=1,
        max_seq_len=128, block_size=BLOCK)
    return torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64), meta


def generate(model, forward, kv_caches) -> dict[str, list[int]]:
    core = ferrollm.EngineCore(block_size=BLOCK, num_blocks=SCRATCH_BLOCK, max_model_len=128, max_num_seqs=4,
                               max_num_batched_tokens=32)
    params = ferrollm.SamplingOptions(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompts = make_prompts(4, seed=0, vocab=384, min_len=3, max_len=40)
    core.add_requests([str(i) for i in range(4)], prompts, [params] * 4)
    tokens = {}
    with torch.inference_mode():
        while core.has_unfinished_requests():
            step = core.schedule()
            meta = AttentionMetadata.from_step(step, BLOCK)
            hidden = forward(torch.from_numpy(step.input_ids), torch.from_numpy(step.positions), kv_caches, meta)
            logits = model.compute_logits(hidden[torch.from_numpy(step.logits_indices)])
            for out in core.update(logits.argmax(-1).numpy().astype(np.int64)):
                tokens[out.request_id] = list(out.token_ids)
    return tokens


def new_caches(model):
    num_layers, num_kv_heads, head_dim = model.kv_cache_spec()
    return allocate_kv_cache(num_layers, NUM_BLOCKS, BLOCK, num_kv_heads, head_dim, torch.float64)


def test_no_compilation_compiles_nothing(model):
    assert compile_model(model, CompilationConfig()) is None
    assert compile_model(model, CompilationConfig(level=0)) is None


@pytest.mark.parametrize("level", [CompilationLevel.DYNAMO_AS_IS, CompilationLevel.DYNAMO_ONCE,
                                   CompilationLevel.PIECEWISE])
def test_compiled_tokens_equal_eager_tokens(model, level):
    torch._dynamo.reset()
    eager = generate(model, model, new_caches(model))
    caches = new_caches(model)
    compiled = compile_model(model, CompilationConfig(level=level, backend="eager"))
    compiled.warm_up(scratch_batch, caches, num_tokens=8)
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    assert [layer.kv_cache_index for layer in layers] == [0, 1]
    assert generate(model, compiled, caches) == eager
    if level == CompilationLevel.PIECEWISE:
        # Each graph Dynamo made (one per shape class) is cut around its two attention calls.
        pieces = compiled.piecewise
        assert pieces.num_graphs >= 1 and pieces.num_attention_pieces == 2 * pieces.num_graphs
        assert pieces.num_compiled_pieces == 3 * pieces.num_graphs


def test_unified_attention_needs_a_forward_context(model):
    q = torch.zeros(1, 64, dtype=torch.float64)
    kv = torch.zeros(1, 32, dtype=torch.float64)
    with pytest.raises(EngineError, match="outside set_forward_context"):
        unified_attention(q, kv, kv, 0, 4, 2, 16, 0.25, None, None)
    _, _, meta = scratch_batch(1)
    with set_forward_context(meta, new_caches(model)):
        out = unified_attention(q, kv, kv, 0, 4, 2, 16, 0.25, None, None)
    assert out.shape == q.shape
