"""Stop conditions and incremental detokenization, end to end through the engine."""

from __future__ import annotations

import numpy as np
import pytest

from ferrollm import EngineCore, SamplingOptions, Tokenizer

MULTIBYTE = "你好，世界 🙂🚀 wörld 天气"


def scripted(engine: EngineCore, scripts: dict[str, list[int]]):
    """Runs the engine with a runner that replays a fixed token list per request."""
    names: dict[int, str] = {}
    produced: dict[str, int] = {}
    outputs = []
    while engine.has_unfinished_requests():
        step = engine.schedule()
        for r in step.scheduled_new_reqs:
            names[r.req_index] = r.request_id
        sampled = []
        for idx, keep in zip(step.req_indices, step.needs_sample):
            name = names[int(idx)]
            n = produced.get(name, 0)
            sampled.append(scripts[name][n] if n < len(scripts[name]) else 3)
            produced[name] = n + int(keep)
        outputs.extend(engine.update(np.array(sampled, dtype=np.int64)))
    return {o.request_id: o for o in outputs}


def test_multibyte_characters_are_never_emitted_broken(tokenizer: Tokenizer):
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    assert len(ids) > len(MULTIBYTE) // 2, "CJK and emoji must span several tokens here"
    prompt = tokenizer.encode("Hello")
    pieces = tokenizer.decode_incrementally(prompt, ids)
    assert "".join(pieces) == MULTIBYTE
    assert all("\ufffd" not in p for p in pieces)
    assert any(p == "" for p in pieces), "some tokens end mid-character and release nothing"


def test_engine_output_text_decodes_multibyte_output(tokenizer_dir, tokenizer: Tokenizer):
    engine = EngineCore(tokenizer=tokenizer_dir, block_size=4, num_blocks=128, max_model_len=256)
    ids = tokenizer.encode(MULTIBYTE, add_special_tokens=False)
    engine.add_requests(["a"], ["Hello"], [SamplingOptions(max_tokens=len(ids))])
    out = scripted(engine, {"a": ids})["a"]
    assert out.text == MULTIBYTE
    assert out.token_ids == ids
    assert out.prompt_token_ids == tokenizer.encode("Hello")


def straddling_stop(tokenizer: Tokenizer, text: str) -> tuple[list[int], str, int]:
    """A stop string made of the end of one token's text and the start of the next."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = tokenizer.decode_incrementally([1], ids)
    k = next(i for i in range(3, len(pieces) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][-2:] + pieces[k + 1][:2]
    start = len("".join(pieces[: k + 1])) - 2
    return ids, stop, start


def test_stop_string_across_tokens_is_found_and_cut(tokenizer_dir, tokenizer: Tokenizer):
    text = "Hello world, the quick brown fox jumps over the lazy dog."
    ids, stop, start = straddling_stop(tokenizer, text)
    engine = EngineCore(tokenizer=tokenizer_dir, block_size=4, num_blocks=128, max_model_len=256)
    engine.add_requests(
        ["cut", "keep"],
        ["Hi", "Hi"],
        [SamplingOptions(max_tokens=50, stop=[stop]), SamplingOptions(max_tokens=50, stop=[stop], include_stop_str_in_output=True)],
    )
    outs = scripted(engine, {"cut": ids, "keep": ids})
    assert outs["cut"].text == text[:start]
    assert outs["keep"].text == text[: start + len(stop)]
    assert outs["cut"].finish_reason == "stop" and outs["cut"].stop_reason == stop


def test_earliest_completing_stop_string_wins(tokenizer_dir, tokenizer: Tokenizer):
    text = "Hello world, the quick brown fox"
    ids = tokenizer.encode(text, add_special_tokens=False)
    engine = EngineCore(tokenizer=tokenizer_dir, block_size=4, num_blocks=128, max_model_len=256)
    engine.add_requests(["a"], ["Hi"], [SamplingOptions(max_tokens=50, stop=["quick brown", "world"])])
    out = scripted(engine, {"a": ids})["a"]
    assert out.text == "Hello "
    assert out.stop_reason == "world"


def test_eos_ends_a_request_unless_ignore_eos_or_before_min_tokens(tokenizer_dir, tokenizer: Tokenizer):
    eos = tokenizer.eos_token_ids[0]
    assert tokenizer.id_to_token(eos) == "</s>"
    words = tokenizer.encode("the lazy dog", add_special_tokens=False)
    script = words[:2] + [eos] + words
    engine = EngineCore(tokenizer=tokenizer_dir, block_size=4, num_blocks=128, max_model_len=256)
    engine.add_requests(
        ["eos", "ignore", "min"],
        ["Hi"] * 3,
        [SamplingOptions(max_tokens=5), SamplingOptions(max_tokens=5, ignore_eos=True), SamplingOptions(max_tokens=5, min_tokens=4)],
    )
    outs = scripted(engine, {"eos": script, "ignore": script, "min": script})
    assert outs["eos"].token_ids == script[:3] and outs["eos"].finish_reason == "stop"
    assert outs["eos"].stop_reason is None
    assert "</s>" not in outs["eos"].text
    assert outs["ignore"].token_ids == script[:5] and outs["ignore"].finish_reason == "length"
    assert outs["min"].token_ids == script[:5]


def test_stop_token_ids_report_the_token(tokenizer_dir, tokenizer: Tokenizer):
    words = tokenizer.encode("the lazy dog jumps", add_special_tokens=False)
    engine = EngineCore(tokenizer=tokenizer_dir, block_size=4, num_blocks=128, max_model_len=256)
    engine.add_requests(["a"], ["Hi"], [SamplingOptions(max_tokens=10, stop_token_ids=[words[2]])])
    out = scripted(engine, {"a": words})["a"]
    assert out.token_ids == words[:3]
    assert out.stop_reason == words[2]


def test_skip_special_tokens_controls_special_token_text(tokenizer: Tokenizer):
    bos = tokenizer.token_to_id("<s>")
    hello = tokenizer.encode("Hello", add_special_tokens=False)
    assert "".join(tokenizer.decode_incrementally([5], [bos] + hello, skip_special_tokens=True)) == "Hello"
    assert "".join(tokenizer.decode_incrementally([5], [bos] + hello, skip_special_tokens=False)) == "<s>Hello"


def test_text_prompts_are_tokenized_by_the_core(tokenizer_dir, tokenizer: Tokenizer):
    engine = EngineCore(tokenizer=tokenizer_dir, block_size=16, num_blocks=64, max_model_len=256)
    prompts = ["Hello world", "你好", "the lazy dog"] * 4
    engine.add_requests([f"r{i}" for i in range(12)], prompts, [SamplingOptions(max_tokens=1)] * 12)
    step = engine.schedule()
    got = [r.prompt_token_ids for r in step.scheduled_new_reqs]
    assert got == tokenizer.encode_batch(prompts)
    assert got[0][0] == tokenizer.bos_token_id
