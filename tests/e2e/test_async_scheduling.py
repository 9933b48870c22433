"""`async_scheduling=True` (issue #27) gives the outputs of the default loop: tokens, logprobs,
texts, finish and stop reasons, for greedy and seeded sampling, n>1, stop strings that end a
request while the next step's update was in flight, max_tokens, preemption and prefix caching;
errors in a step still reach the caller and leave the engine usable."""

from __future__ import annotations

import threading

import pytest
import torch
from e2e.test_llm_generate import prompts_for
from e2e.test_scheduling_options import spy_on

from ferrollm import LLM, SamplingParams


def _summary(outs) -> list:
    rows = []
    for o in outs:
        rows.append((o.prompt_token_ids, o.num_cached_tokens, [
            (c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason,
             None if c.logprobs is None else [{k: round(v.logprob, 4) for k, v in d.items()} for d in c.logprobs])
            for c in o.outputs]))
    return rows


def _generate(path, prompts, params, **kw):
    with LLM(model=str(path), max_model_len=64, seed=0, **kw) as llm:
        return _summary(llm.generate(prompts, params, use_tqdm=False))


def _params(stop: str) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]),
        SamplingParams(max_tokens=7, temperature=0.9, seed=3, n=3, ignore_eos=True, logprobs=1),
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
        SamplingParams(max_tokens=12, temperature=0.8, seed=5, ignore_eos=True, stop=[stop]),
    ]


def _stop_string(path, prompt) -> str:
    """A piece of the greedy text a few tokens in, so the stop ends the request mid-run."""
    with LLM(model=str(path), max_model_len=64) as llm:
        (out,) = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                              use_tqdm=False)
    text = out.outputs[0].text
    return text[len(text) // 2: len(text) // 2 + 3]


def test_outputs_match_the_default_loop(tiny_llama):
    path, hf_model = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in prompts_for(hf_model.config.vocab_size)[:5]]
    params = _params(_stop_string(path, prompts[1]))
    expected = _generate(path, prompts, params)
    assert expected[1][2][0][3] == "stop" and len(expected[1][2][0][1]) < 12
    assert _generate(path, prompts, params, async_scheduling=True) == expected
    assert _generate(path, prompts, params, async_scheduling=False) == expected


def test_preemption_and_prefix_caching_match_the_default_loop(tiny_llama):
    path, hf_model = tiny_llama
    base = prompts_for(hf_model.config.vocab_size)
    # Shared 32-token prefixes hit the prefix cache; 9 blocks cannot hold every sequence at once.
    prompts = [{"prompt_token_ids": base[4][:32] + p[:6]} for p in base[:6]]
    params = SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)
    kw = {"num_gpu_blocks_override": 9, "max_num_seqs": 6}
    expected = _generate(path, prompts, params, **kw)
    with LLM(model=str(path), max_model_len=64, seed=0, async_scheduling=True, **kw) as llm:
        spy = spy_on(llm)
        got = _summary(llm.generate(prompts, params, use_tqdm=False))
    assert spy.preempted and got == expected
    assert any(row[1] > 0 for row in got)


def test_a_failing_step_reaches_the_caller_and_the_engine_goes_on(tiny_llama, monkeypatch):
    path, hf_model = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in prompts_for(hf_model.config.vocab_size)[:3]]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (3, 5, 9)]
    with LLM(model=str(path), max_model_len=64, async_scheduling=True) as llm:
        expected = _summary(llm.generate(prompts, params, use_tqdm=False))
        spy = spy_on(llm)
        calls = {"n": 0, "threads": set()}

        def failing_update(sampled):
            calls["n"] += 1
            calls["threads"].add(threading.current_thread().name)
            if calls["n"] == 3:  # on the worker thread, while the caller holds step 2's outputs
                raise RuntimeError("update broke")
            return spy._core.update(sampled)

        monkeypatch.setattr(spy, "update", failing_update)
        with pytest.raises(RuntimeError, match="update broke"):
            llm.generate(prompts, params, use_tqdm=False)
        assert calls["threads"] == {"ferrollm-update_0"}
        monkeypatch.undo()
        llm.llm_engine.abort_all()
        assert not llm.llm_engine.has_unfinished_requests()
        runner = llm.llm_engine.generation_runner
        real = runner.execute_model
        steps = {"n": 0}

        def failing_model(step):
            steps["n"] += 1
            if steps["n"] == 6:  # just after the 5-token request finished: its held state is dropped
                raise ValueError("model broke")
            return real(step)

        monkeypatch.setattr(runner, "execute_model", failing_model)
        with pytest.raises(ValueError, match="model broke"):
            llm.generate(prompts, params, use_tqdm=False)
        assert not runner._held and not llm.llm_engine.has_unfinished_requests()
        monkeypatch.setattr(runner, "execute_model", real)
        assert _summary(llm.generate(prompts, params, use_tqdm=False)) == expected
        assert not runner.requests and not runner._held


def test_a_pooling_model_pools_the_same(tiny_llama):
    path, hf_model = tiny_llama
    prompts = [{"prompt_token_ids": p} for p in prompts_for(hf_model.config.vocab_size)[:4]]
    got = []
    for flag in (None, True):
        with LLM(model=str(path), runner="pooling", async_scheduling=flag) as llm:
            got.append([torch.tensor(o.outputs.embedding) for o in llm.embed(prompts, use_tqdm=False)])
    assert all(torch.equal(a, b) for a, b in zip(*got))
