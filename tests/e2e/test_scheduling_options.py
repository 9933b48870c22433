"""vLLM's scheduling and KV cache sizing options end to end (issue #27): `num_gpu_blocks_override`,
`kv_cache_memory_bytes`, `enable_chunked_prefill`, `long_prefill_token_threshold`,
`scheduling_policy` with `priority`, on a tiny random checkpoint against transformers.

A spy between the engine and its core records every step, so the tests see what vLLM's
semantics promise (a prompt in one step, the per-request cap, which request ran or was preempted
first) and not only the final tokens.
"""

from __future__ import annotations

import logging

import pytest
from e2e.test_llm_generate import _kv_gib, greedy, hf_greedy, prompts_for

from ferrollm import LLM
from ferrollm import exceptions as exc


class StepSpy:
    """Stands in for an engine's core: forwards everything, records each step."""

    def __init__(self, core):
        self._core = core
        self.steps: list[dict] = []
        self.finished: list[str] = []
        self.preempted: list[str] = []
        self._ids: dict[int, str] = {}

    def __getattr__(self, name):
        return getattr(self._core, name)

    def schedule(self):
        step = self._core.schedule()
        for new in step.scheduled_new_reqs:
            self._ids[new.req_index] = new.request_id
        self.preempted += [self._ids[int(i)] for i in step.preempted_req_indices]
        self.steps.append({
            "ids": [self._ids[int(i)] for i in step.req_indices],
            "tokens": step.num_scheduled_tokens.tolist(),
            "new": {n.request_id: len(n.prompt_token_ids) for n in step.scheduled_new_reqs},
            "live": self._core.stats()["num_running"] + self._core.stats()["num_waiting"],
        })
        return step

    def update(self, sampled):
        outs = self._core.update(sampled)
        self.finished += [o.request_id for o in outs]
        return outs


def spy_on(llm: LLM) -> StepSpy:
    engine = llm.llm_engine
    assert engine is not None
    spy = StepSpy(engine.core)
    engine.core = spy
    return spy


def token_prompts(hf_model) -> list[dict]:
    return [{"prompt_token_ids": p} for p in prompts_for(hf_model.config.vocab_size)]


# -- KV cache size ---------------------------------------------------------------------------------


def test_num_gpu_blocks_override_sets_the_cpu_pool_and_the_log_says_so(tiny_llama, caplog):
    path, hf_model = tiny_llama
    with caplog.at_level(logging.INFO, logger="ferrollm"), LLM(model=str(path), max_model_len=64,
                                                                num_gpu_blocks_override=23) as llm:
        engine = llm.llm_engine
        assert all(t.shape[1] == 23 for t in engine.runner.kv_caches)
        assert engine.core.stats()["num_free_blocks"] == 22  # one is the null block
        prompts = token_prompts(hf_model)[:3]
        outs = llm.generate(prompts, greedy(6), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p["prompt_token_ids"], 6)
    assert "23 blocks of 16 tokens" in caplog.text and "sized by num_gpu_blocks_override=23" in caplog.text


def test_num_gpu_blocks_override_too_small_for_one_sequence_is_refused(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(exc.KVCacheTooSmallError, match=r"`num_gpu_blocks_override`=4 .* >= 5"):
        LLM(model=str(path), max_model_len=64, num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="num_gpu_blocks_override"):
        LLM(model=str(path), num_gpu_blocks_override=1)


def test_kv_cache_memory_bytes_replaces_the_cpu_budget(tiny_llama, monkeypatch, caplog):
    path, hf_model = tiny_llama
    monkeypatch.setenv("FERROLLM_CPU_KVCACHE_SPACE", "1")  # ignored: the option wins
    budget = int(_kv_gib(hf_model, tokens=200) * (1 << 30))
    with caplog.at_level(logging.INFO, logger="ferrollm"), LLM(model=str(path), max_model_len=64,
                                                                kv_cache_memory_bytes=budget) as llm:
        kv_bytes = sum(t.numel() * t.element_size() for t in llm.llm_engine.runner.kv_caches)
    per_block = kv_bytes // (200 // 16)
    assert kv_bytes <= budget < kv_bytes + per_block
    assert f"sized by kv_cache_memory_bytes={budget}" in caplog.text
    assert f"({kv_bytes} bytes," in caplog.text


# -- chunked prefill -------------------------------------------------------------------------------


def test_without_chunked_prefill_each_prompt_is_prefilled_in_one_step(tiny_llama):
    path, hf_model = tiny_llama
    prompts = token_prompts(hf_model)
    # The budget would split the 41- and 50-token prompts if chunking were on.
    with LLM(model=str(path), max_model_len=64, max_num_batched_tokens=64, max_num_seqs=8,
             enable_chunked_prefill=False) as llm:
        spy = spy_on(llm)
        outs = llm.generate(prompts, greedy(5), use_tqdm=False)
    for step in spy.steps:
        for rid, n in zip(step["ids"], step["tokens"]):
            if rid in step["new"]:
                assert n == step["new"][rid], "a new prompt was split"
    assert sum(len(s["new"]) for s in spy.steps) == len(prompts)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p["prompt_token_ids"], 5)


def test_without_chunked_prefill_the_default_budget_holds_max_model_len(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path), max_model_len=128, max_num_seqs=1, enable_chunked_prefill=False) as llm:
        long_prompt = {"prompt_token_ids": [5 + i % 200 for i in range(120)]}
        spy = spy_on(llm)
        llm.generate([long_prompt], greedy(2), use_tqdm=False)
    assert spy.steps[0]["tokens"] == [120]


def test_without_chunked_prefill_a_budget_below_max_model_len_is_refused_in_vllms_words(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) is smaller than max_model_len \(64\)"):
        LLM(model=str(path), max_model_len=64, max_num_batched_tokens=32, enable_chunked_prefill=False)


def test_long_prefill_token_threshold_caps_each_request_per_step(tiny_llama):
    path, hf_model = tiny_llama
    prompts = token_prompts(hf_model)
    with LLM(model=str(path), max_model_len=64, long_prefill_token_threshold=8) as llm:
        spy = spy_on(llm)
        outs = llm.generate(prompts, greedy(4), use_tqdm=False)
    assert all(n <= 8 for s in spy.steps if s["live"] > 1 for n in s["tokens"])
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p["prompt_token_ids"], 4)


def test_long_prefill_token_threshold_above_max_model_len_is_refused(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        LLM(model=str(path), max_model_len=64, long_prefill_token_threshold=65)


# -- priority --------------------------------------------------------------------------------------


def test_priority_policy_runs_lowest_value_first(tiny_llama):
    path, hf_model = tiny_llama
    prompts = token_prompts(hf_model)[:4]
    with LLM(model=str(path), max_model_len=64, max_num_seqs=1, scheduling_policy="priority") as llm:
        spy = spy_on(llm)
        outs = llm.generate(prompts, greedy(3), use_tqdm=False, priority=[3, 1, 2, 0])
    ids = [o.request_id for o in outs]
    assert spy.finished == [ids[3], ids[1], ids[2], ids[0]]
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p["prompt_token_ids"], 3)


def test_priority_policy_preempts_the_lowest_priority_running_request(tiny_llama):
    path, hf_model = tiny_llama
    prompts = token_prompts(hf_model)[:3]
    # 12 usable blocks of 4 tokens: the three requests, growing to ~40 tokens each, cannot all fit.
    with LLM(model=str(path), max_model_len=48, block_size=4, num_gpu_blocks_override=13,
             scheduling_policy="priority") as llm:
        spy = spy_on(llm)
        outs = llm.generate(prompts, greedy(20), use_tqdm=False, priority=[0, 5, 1])
    ids = [o.request_id for o in outs]
    assert spy.preempted and set(spy.preempted) <= {ids[1], ids[2]}
    # The first victim is the largest value while all three run.
    assert spy.preempted[0] == ids[1]
    assert spy.finished[0] == ids[0]
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p["prompt_token_ids"], 20)


def test_priority_under_fcfs_is_accepted_and_ignored(tiny_llama):
    path, hf_model = tiny_llama
    prompts = token_prompts(hf_model)[:3]
    with LLM(model=str(path), max_model_len=64, max_num_seqs=1) as llm:
        spy = spy_on(llm)
        outs = llm.generate(prompts, greedy(2), use_tqdm=False, priority=[9, 0, -3])
    assert spy.finished == [o.request_id for o in outs]


def test_priority_forms_and_chat(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path), max_model_len=64, max_num_seqs=1, scheduling_policy="priority") as llm:
        outs = llm.generate(["a", "b"], greedy(1), use_tqdm=False, priority=2)
        assert len(outs) == 2
        with pytest.raises(ValueError, match=r"lengths of prompts \(2\) and priority \(3\)"):
            llm.generate(["a", "b"], greedy(1), use_tqdm=False, priority=[1, 2, 3])
        template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        chats = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "yo"}]]
        spy = spy_on(llm)
        outs = llm.chat(chats, greedy(1), use_tqdm=False, chat_template=template, priority=[1, 0])
    assert spy.finished == [outs[1].request_id, outs[0].request_id]


def test_bad_scheduling_options_are_refused_by_name(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="scheduling_policy"):
        LLM(model=str(path), scheduling_policy="lifo")


@pytest.mark.parametrize("option", [{"enable_chunked_prefill": True}, {"long_prefill_token_threshold": 8},
                                    {"num_gpu_blocks_override": 64}, {"kv_cache_memory_bytes": 1 << 20}])
def test_a_pooling_model_refuses_options_it_has_nothing_for(tiny_llama, option):
    path, _ = tiny_llama
    with pytest.raises(NotImplementedError, match=f"`{next(iter(option))}=.*pooling model"):
        LLM(model=str(path), runner="pooling", **option)


def test_a_pooling_model_takes_the_priority_policy(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path), runner="pooling", scheduling_policy="priority", max_model_len=64) as llm:
        assert len(llm.embed(["a", "b"], use_tqdm=False)) == 2
