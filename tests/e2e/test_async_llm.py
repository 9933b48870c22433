"""`AsyncLLM`: outputs stream per token, equal `LLM.generate`'s, batch across coroutines, abort."""

from __future__ import annotations

import asyncio

import pytest
from ferrollm import LLM, AsyncLLM, EngineArgs, RequestOutputKind, SamplingParams
from ferrollm.exceptions import InvalidRequestError

PROMPTS = [[5, 9, 17, 3], [40, 41, 42, 43, 44, 45], [7, 8]]


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def engine(tiny_llama):
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_llama[0]), max_num_seqs=8))
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def offline(tiny_llama):
    with LLM(model=str(tiny_llama[0])) as llm:
        yield llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(8, logprobs=2), use_tqdm=False)


async def _collect(engine, prompt, params, rid):
    return [out async for out in engine.generate({"prompt_token_ids": prompt}, params, rid)]


def test_concurrent_requests_stream_the_offline_tokens(engine, offline):
    async def main():
        return await asyncio.gather(*[_collect(engine, p, greedy(8, logprobs=2), f"r{i}") for i, p in enumerate(PROMPTS)])

    for outs, want in zip(asyncio.run(main()), offline):
        # One cumulative output per step while the consumer keeps up; steps that finish while it
        # is behind (a loaded machine) arrive merged, so the counts only grow, up to 8.
        counts = [len(o.outputs[0].token_ids) for o in outs]
        assert counts == sorted(set(counts)) and counts[-1] == 8
        last = outs[-1]
        assert last.finished and not any(o.finished for o in outs[:-1])
        assert last.outputs[0].token_ids == want.outputs[0].token_ids
        assert last.outputs[0].text == want.outputs[0].text
        assert last.outputs[0].finish_reason == "length"
        assert len(last.outputs[0].logprobs) == 8
        assert last.outputs[0].cumulative_logprob == pytest.approx(want.outputs[0].cumulative_logprob, abs=1e-4)


def test_delta_outputs_add_up_to_the_cumulative_ones(engine):
    def sampled(kind):
        return SamplingParams(max_tokens=6, n=2, temperature=1.0, seed=3, ignore_eos=True, output_kind=kind)

    deltas = asyncio.run(_collect(engine, PROMPTS[0], sampled(RequestOutputKind.DELTA), "delta"))
    whole = asyncio.run(_collect(engine, PROMPTS[0], sampled(RequestOutputKind.CUMULATIVE), "whole"))[-1]
    tokens: dict[int, list[int]] = {0: [], 1: []}
    text = {0: "", 1: ""}
    for o in deltas:
        for c in o.outputs:
            tokens[c.index] += c.token_ids
            text[c.index] += c.text
    assert deltas[-1].finished
    for c in whole.outputs:
        assert tokens[c.index] == c.token_ids and text[c.index] == c.text and len(c.token_ids) == 6


def test_a_slow_consumer_gets_merged_outputs(engine, offline):
    async def slow(kind):
        outs = []
        async for out in engine.generate({"prompt_token_ids": PROMPTS[0]}, greedy(8, output_kind=kind), f"slow{kind}"):
            outs.append(out)
            await asyncio.sleep(0.3)  # several steps pile up meanwhile
        return outs

    want = offline[0].outputs[0]
    for kind in (RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA):
        outs = asyncio.run(slow(kind))
        assert len(outs) < 8 and outs[-1].finished
        if kind == RequestOutputKind.CUMULATIVE:
            assert outs[-1].outputs[0].token_ids == want.token_ids and outs[-1].outputs[0].text == want.text
        else:
            assert sum((o.outputs[0].token_ids for o in outs), []) == want.token_ids
            assert "".join(o.outputs[0].text for o in outs) == want.text


def test_final_only_yields_once(engine):
    outs = asyncio.run(_collect(engine, PROMPTS[1], greedy(5, output_kind=RequestOutputKind.FINAL_ONLY), "final"))
    assert len(outs) == 1 and outs[0].finished and len(outs[0].outputs[0].token_ids) == 5


def test_abort_ends_the_stream_and_frees_blocks(engine):
    async def main():
        gen = engine.generate({"prompt_token_ids": PROMPTS[0]}, greedy(500), "long")
        first = await gen.__anext__()
        engine.abort("long")
        rest = [o async for o in gen]
        return first, rest

    first, rest = asyncio.run(main())
    assert not first.finished and all(not o.finished for o in rest)
    asyncio.run(_collect(engine, PROMPTS[2], greedy(2), "after"))  # the loop still serves
    stats = engine.engine.core.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0
    assert not engine.engine.stats.requests  # no per-request timing left behind


def test_closing_the_generator_aborts_its_request(engine):
    async def main():
        gen = engine.generate({"prompt_token_ids": PROMPTS[0]}, greedy(500), "closed")
        await gen.__anext__()
        await gen.aclose()
        return await _collect(engine, PROMPTS[2], greedy(2), "next")

    assert asyncio.run(main())[-1].finished
    stats = engine.engine.core.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


def test_bad_request_fails_its_generator_only(engine):
    async def main():
        bad = _collect(engine, PROMPTS[0], SamplingParams(max_tokens=2, logprobs=10_000), "bad")
        good = _collect(engine, PROMPTS[1], greedy(3), "good")
        return await asyncio.gather(bad, good, return_exceptions=True)

    bad, good = asyncio.run(main())
    assert isinstance(bad, ValueError) and "logprobs" in str(bad)
    assert good[-1].finished


def test_readme_async_example_runs(tiny_llama, capsys):
    import re
    import textwrap
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "AsyncLLM.from_engine_args" in b)
    code = block.replace('"path/to/checkpoint"', repr(str(tiny_llama[0])))
    wrapped = ("import asyncio\nfrom ferrollm import AsyncLLM, EngineArgs, SamplingParams\n"
               "async def main():\n" + textwrap.indent(code, "    ") + "asyncio.run(main())\n")
    exec(compile(wrapped, "README.md", "exec"), {})
    assert capsys.readouterr().out  # one cumulative text per token


def test_encode_embeds_like_llm_embed(tiny_bert):
    prompts = [[1, 40, 41, 42], list(range(3, 60)), [1, 7]]
    engine = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny_bert[0]), max_num_seqs=2))
    try:
        async def main():
            async def one(i, p):
                return [o async for o in engine.encode({"prompt_token_ids": p}, None, f"e{i}")]

            return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

        outs = asyncio.run(main())
        with pytest.raises(InvalidRequestError, match="pooling model"):
            asyncio.run(_collect(engine, prompts[0], greedy(1), "g"))
    finally:
        engine.shutdown()
    with LLM(model=str(tiny_bert[0])) as llm:
        want = llm.embed([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for got, w in zip(outs, want):
        assert len(got) == 1 and got[0].finished and got[0].prompt_token_ids == w.prompt_token_ids
        assert got[0].outputs.data.tolist() == pytest.approx(w.outputs.embedding, abs=1e-6)


def test_a_failing_step_fails_its_requests_and_the_loop_serves_on(engine, monkeypatch):
    runner = engine.engine.runner
    real = runner.execute_model
    calls = {"n": 0}

    def flaky(step):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom in the model")
        return real(step)

    monkeypatch.setattr(runner, "execute_model", flaky)

    async def main():
        return await asyncio.gather(*[_collect(engine, p, greedy(6), f"fail{i}") for i, p in enumerate(PROMPTS)],
                                    return_exceptions=True)

    results = asyncio.run(main())
    assert all(isinstance(r, RuntimeError) and "boom" in str(r) for r in results)
    assert asyncio.run(_collect(engine, PROMPTS[0], greedy(3), "after-fail"))[-1].finished
    assert engine.errored is False
