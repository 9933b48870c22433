"""The engine on a GPU: tokens equal the CPU's, bf16 logprobs close to transformers' on the same
GPU, CUDA graphs and every compilation level give the eager tokens, and the KV cache is sized by
a profiling run.

Needs a CUDA device and compiled Triton kernels: ``TRITON_INTERPRET=0 pytest -m gpu``.
"""

from __future__ import annotations

import gc
import logging
import os
import re

import pytest
import torch
import transformers
from helpers.checkpoints import checkpoint_with_tokenizer
from helpers.logprobs_close import check_logprobs_close, top_logprobs

from ferrollm import LLM, SamplingParams
from ferrollm.config import CompilationConfig
from ferrollm.exceptions import KVCacheTooSmallError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                       reason="needs a CUDA device and TRITON_INTERPRET=0"),
]

PROMPT_LENS = [3, 7, 12, 18, 25, 33, 41, 50]
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tokenizer_dir):
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = checkpoint_with_tokenizer(kind, tmp_path_factory.mktemp(kind), tokenizer_dir)
        return made[kind]

    return get


def prompts(n: int = len(PROMPT_LENS)) -> list[dict]:
    g = torch.Generator().manual_seed(7)
    return [{"prompt_token_ids": torch.randint(3, 384, (k,), generator=g).tolist()} for k in PROMPT_LENS[:n]]


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


def generate(path, params=None, **engine_kw):
    with LLM(model=str(path), max_num_seqs=8, **engine_kw) as llm:
        outs = llm.generate(prompts(), params or greedy(), use_tqdm=False)
        runner = llm.llm_engine.generation_runner
        graphs = runner.cuda_graphs
        info = {"sizes": sorted(graphs.graphs) if graphs else [], "replays": graphs.num_replays if graphs else 0,
                "compiled": runner.forward is not runner.model, "profile": llm.llm_engine.memory_profile,
                "piecewise": getattr(runner.forward, "piecewise", None)}
    return [o.outputs[0] for o in outs], info


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "mixtral"])
def test_greedy_tokens_on_the_gpu_equal_the_cpus(checkpoints, kind):
    path = checkpoints(kind)
    cpu, _ = generate(path, device="cpu", dtype="float32")
    gpu, info = generate(path, device="cuda", dtype="float32")
    assert [c.token_ids for c in gpu] == [c.token_ids for c in cpu]
    # Graphs are on by default, except for the MoE model whose layers sync with the host.
    if kind == "mixtral":
        assert info["sizes"] == [] and info["replays"] == 0
    else:
        assert info["sizes"] == [1, 2, 4, 8] and info["replays"] >= MAX_TOKENS - 2


def hf_top_logprobs(model, prompt: list[int], n: int, k: int) -> tuple[list[int], list[dict[int, float]]]:
    """transformers' greedy tokens and each step's top-k logprobs (full forward every step)."""
    seq, tops = list(prompt), []
    with torch.no_grad():
        for _ in range(n):
            logprobs = model(torch.tensor([seq], device="cuda")).logits[0, -1].float().log_softmax(-1)
            top = logprobs.topk(k)
            tops.append(dict(zip(top.indices.tolist(), top.values.tolist())))
            seq.append(int(top.indices[0]))
    return seq[len(prompt):], tops


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gemma2", "mixtral"])
def test_bf16_logprobs_are_close_to_transformers_on_the_same_gpu(checkpoints, kind):
    """vLLM's `check_logprobs_close`: where the greedy tokens first differ, each engine's token must
    be in the other's top-5 at that position; before that, the tokens are equal."""
    path = checkpoints(kind)
    ours, _ = generate(path, greedy(logprobs=5), device="cuda", dtype="bfloat16")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                           attn_implementation="eager").cuda().eval()
    compared = 0
    for p, out in zip(prompts(), ours):
        theirs = hf_top_logprobs(hf, p["prompt_token_ids"], MAX_TOKENS, 5)
        compared += check_logprobs_close((out.token_ids, top_logprobs(out)), theirs,
                                         f"prompt {len(p['prompt_token_ids'])}")
    assert compared >= len(ours)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_tokens_equal_enforce_eager_tokens(checkpoints, dtype, caplog):
    path = checkpoints("llama")
    with caplog.at_level(logging.INFO, logger="ferrollm"):
        graphed, info = generate(path, device="cuda", dtype=dtype)
    eager, eager_info = generate(path, device="cuda", dtype=dtype, enforce_eager=True)
    assert [c.token_ids for c in graphed] == [c.token_ids for c in eager]
    assert info["sizes"] == [1, 2, 4, 8] and info["replays"] > 0
    assert eager_info["sizes"] == [] and eager_info["replays"] == 0
    assert re.search(r"CUDA graphs: captured 4 decode batch sizes \(1, 2, 4, 8\) in [\d.]+ s, [\d.]+ MiB",
                     caplog.text), caplog.text


def test_capture_sizes_follow_vllms_defaults_capped_by_max_num_seqs(checkpoints):
    path = checkpoints("llama")
    with LLM(model=str(path), device="cuda", max_num_seqs=20) as llm:
        graphs = llm.llm_engine.generation_runner.cuda_graphs
        assert sorted(graphs.graphs) == [1, 2, 4, 8, 16, 24]
    with LLM(model=str(path), device="cuda", max_num_seqs=20,
             compilation_config={"cudagraph_capture_sizes": [1, 3]}) as llm:
        assert sorted(llm.llm_engine.generation_runner.cuda_graphs.graphs) == [1, 3]


@pytest.mark.parametrize("kind,level", [("llama", 1), ("llama", 2), ("llama", 3), ("gemma2", 3)])
def test_compiled_levels_give_the_eager_tokens(checkpoints, kind, level, caplog):
    path = checkpoints(kind)
    eager, _ = generate(path, device="cuda", dtype="float32", compilation_config=0)
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="ferrollm"):
        compiled, info = generate(path, device="cuda", dtype="float32", compilation_config=level)
    assert info["compiled"] and info["sizes"] == [1, 2, 4, 8] and info["replays"] > 0
    assert [c.token_ids for c in compiled] == [c.token_ids for c in eager]
    assert "torch.compile (" in caplog.text
    if level == 3:
        layers = 3 if kind == "gemma2" else 2
        pieces = info["piecewise"]
        assert pieces.num_attention_pieces == layers * pieces.num_graphs
        assert pieces.num_compiled_pieces == (layers + 1) * pieces.num_graphs


def test_kv_cache_is_sized_by_a_profiling_run(checkpoints):
    path = checkpoints("qwen2")
    with LLM(model=str(path), device="cuda", gpu_memory_utilization=0.5, max_model_len=256) as llm:
        llm.generate(prompts(), greedy(), use_tqdm=False)
        profile = llm.llm_engine.memory_profile
        kv_bytes = sum(t.numel() * t.element_size() for t in llm.llm_engine.runner.kv_caches)
        free, total = torch.cuda.mem_get_info()
    # A tiny model's two probe graphs may take no memory the driver reports (it sub-allocates).
    assert profile.activation_peak > 0 and profile.graphs >= 0 and profile.in_use > 0
    assert kv_bytes <= profile.kv_cache_budget(0.5)
    assert total - free <= 0.5 * total, "the device holds more than gpu_memory_utilization of it"


def test_an_impossible_max_model_len_names_the_largest_that_fits(checkpoints):
    path = checkpoints("llama")
    kw = dict(device="cuda", max_num_seqs=1, max_model_len=1 << 20,
              hf_overrides={"max_position_embeddings": 1 << 20})
    with LLM(model=str(path), **kw) as llm:
        p = llm.llm_engine.memory_profile
    del llm
    gc.collect()
    # Leave the cache ~64 MiB: an eighth of what one 1M-token sequence of this model needs.
    utilization = (p.in_use + p.activation_peak + p.graphs + p.non_torch + (64 << 20)) / p.total
    with pytest.raises(KVCacheTooSmallError) as info:
        LLM(model=str(path), gpu_memory_utilization=utilization, **kw)
    message = str(info.value)
    fits = int(re.search(r"the largest `max_model_len` that fits is (\d+)", message).group(1))
    assert 16 <= fits < 1 << 20 and "`gpu_memory_utilization`" in message, message
