"""`LLM.generate` end to end on tiny random checkpoints, against transformers' own forward pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ferrollm import LLM, SamplingParams
from ferrollm import exceptions as exc

PROMPT_LENS = [3, 7, 12, 18, 25, 33, 41, 50]


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_greedy(hf_model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding with transformers' full forward pass at every step (no EOS handling,
    like `ignore_eos`; `generate(min_new_tokens=...)` would mask EOS instead)."""
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(hf_model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def hf_logprobs(hf_model, seq: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([seq])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(params=["llama", "qwen2"])
def tiny(request, tiny_llama, tiny_qwen2):
    return {"llama": tiny_llama, "qwen2": tiny_qwen2}[request.param]


@pytest.mark.parametrize(
    "engine_kw",
    [
        {},
        {"enable_prefix_caching": False},
        {"max_num_batched_tokens": 16, "max_num_seqs": 4},
    ],
    ids=["default", "no-prefix-cache", "chunked-prefill"],
)
def test_greedy_matches_transformers(tiny, engine_kw):
    path, hf_model = tiny
    prompts = prompts_for(hf_model.config.vocab_size)
    with LLM(model=str(path), **engine_kw) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(8), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o.prompt_token_ids == p
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 8)


def test_greedy_survives_preemption(tiny, monkeypatch):
    path, hf_model = tiny
    # Room for about two of the eight sequences at a time: the scheduler must preempt.
    monkeypatch.setenv("FERROLLM_CPU_KVCACHE_SPACE", str(_kv_gib(hf_model, tokens=128)))
    prompts = prompts_for(hf_model.config.vocab_size)
    with LLM(model=str(path), max_model_len=64, block_size=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(12), use_tqdm=False)
        assert llm.llm_engine.core.stats()["num_preemptions"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == hf_greedy(hf_model, p, 12)


def _kv_gib(hf_model, tokens: int) -> float:
    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 4
    return tokens * per_token / (1 << 30)


def test_top5_logprobs_match_transformers(tiny):
    path, hf_model = tiny
    prompts = prompts_for(hf_model.config.vocab_size)[:4]
    with LLM(model=str(path)) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(4, logprobs=5, prompt_logprobs=5), use_tqdm=False)
    for p, o in zip(prompts, outs):
        c = o.outputs[0]
        ref = hf_logprobs(hf_model, p + c.token_ids)
        for j, (tok, entry) in enumerate(zip(c.token_ids, c.logprobs)):
            row = ref[len(p) - 1 + j]
            assert entry[tok].rank == 1
            top = torch.topk(row, 5)
            for tid, lp in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(entry[tid].logprob - lp) < 1e-3
        assert c.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)))
        assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
        for i in range(1, len(p)):
            assert abs(o.prompt_logprobs[i][p[i]].logprob - ref[i - 1, p[i]].item()) < 1e-3


def test_outputs_keep_input_order_and_text_prompts_work(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path)) as llm:
        texts = ["hello world", "the quick brown fox", "a"]
        outs = llm.generate(texts, greedy(3), use_tqdm=False)
        assert [o.prompt for o in outs] == texts
        tok = llm.get_tokenizer()
        assert [o.prompt_token_ids for o in outs] == [tok(t)["input_ids"] for t in texts]
        assert [int(o.request_id) for o in outs] == sorted(int(o.request_id) for o in outs)


def test_n_and_seed_are_reproducible(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path)) as llm:
        p = SamplingParams(n=3, temperature=1.0, seed=123, max_tokens=8, ignore_eos=True)
        a = llm.generate(["hello"], p, use_tqdm=False)[0]
        # The same seeded request in a busier batch gives the same tokens.
        b = llm.generate(["hello", "other prompt", "third"], p, use_tqdm=False)[0]
        assert [c.index for c in a.outputs] == [0, 1, 2]
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        assert len({tuple(c.token_ids) for c in a.outputs}) > 1, "children use seed + i"


def test_seeded_requests_keep_their_tokens_as_the_batch_around_them_changes(tiny_llama):
    # Requests end at different steps and one waits on `min_tokens`, so the runner's reused
    # sampling metadata must follow each change of who samples, and with which settings.
    path, hf = tiny_llama
    eos = hf.config.eos_token_id
    params = [SamplingParams(temperature=0.7, seed=1, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=1.3, top_k=5, seed=2, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=8, min_tokens=5, stop_token_ids=[eos],
                             logit_bias={eos: 30.0})]
    prompts = ["one", "two words", "three more words", "four"]
    with LLM(model=str(path)) as llm:
        alone = [llm.generate([q], p, use_tqdm=False)[0].outputs[0].token_ids for q, p in zip(prompts, params)]
        together = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert together == alone
    assert [len(t) for t in alone[:3]] == [3, 9, 6]
    # The bias makes EOS all but certain: held back for min_tokens, then drawn at once.
    assert len(alone[3]) == 6 and alone[3][-1] == eos and eos not in alone[3][:5]


def test_length_cap_and_max_model_len(tiny_llama):
    path, _ = tiny_llama
    with LLM(model=str(path), max_model_len=20) as llm:
        out = llm.generate([{"prompt_token_ids": list(range(3, 18))}], greedy(100), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 5 and out.outputs[0].finish_reason == "length"
        with pytest.raises(exc.PromptTooLongError):
            llm.generate([{"prompt_token_ids": list(range(3, 23))}], greedy(1), use_tqdm=False)


def test_stop_token_ids_and_stop_strings_end_to_end(tiny_llama):
    path, hf_model = tiny_llama
    with LLM(model=str(path)) as llm:
        base = llm.generate(["hello world"], greedy(12), use_tqdm=False)[0].outputs[0]
        stop_tok = base.token_ids[4]
        first = base.token_ids.index(stop_tok)
        out = llm.generate(["hello world"], greedy(12, stop_token_ids=[stop_tok]), use_tqdm=False)[0].outputs[0]
        assert out.token_ids == base.token_ids[: first + 1]
        assert out.finish_reason == "stop" and out.stop_reason == stop_tok
        text = base.text
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        if stop.strip():
            cut = llm.generate(["hello world"], greedy(12, stop=[stop]), use_tqdm=False)[0].outputs[0]
            assert cut.text == text[: text.index(stop)]
            assert cut.stop_reason == stop


def test_validation_errors_name_the_problem(tiny_llama):
    path, _ = tiny_llama
    with pytest.raises(TypeError, match="not_an_option"):
        LLM(model=str(path), not_an_option=1)
    with pytest.raises(exc.ConfigError, match="max_model_len"):
        LLM(model=str(path), max_model_len=10**7)
    with LLM(model=str(path)) as llm:
        with pytest.raises(ValueError, match="sampling_params"):
            llm.generate(["a", "b"], [greedy(2)] * 3, use_tqdm=False)
        with pytest.raises(ValueError, match="prompt_token_ids"):
            llm.generate([{"prompt_token_ids": [10**6]}], use_tqdm=False)
        with pytest.raises(ValueError, match="temperature"):
            llm.generate(["a"], SamplingParams(temperature=-1), use_tqdm=False)
        # A bad request leaves the engine usable.
        assert len(llm.generate(["a"], greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_unknown_architecture_names_it_and_hf_overrides(tiny_llama, tmp_path):
    import json
    import shutil

    path, _ = tiny_llama
    copy = tmp_path / "renamed"
    shutil.copytree(path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["architectures"] = ["MysteryForCausalLM"]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(exc.ConfigError) as info:
        LLM(model=str(copy))
    msg = str(info.value)
    assert "MysteryForCausalLM" in msg and "LlamaForCausalLM" in msg and "hf_overrides" in msg
    with LLM(model=str(copy), hf_overrides={"architectures": ["LlamaForCausalLM"]}) as llm:
        assert llm.llm_engine.model_config.architecture == "LlamaForCausalLM"

    def fix(config):
        config.architectures = ["LlamaForCausalLM"]
        return config

    with LLM(model=str(copy), hf_overrides=fix) as llm:
        assert len(llm.generate(["x"], greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


def test_kv_cache_too_small_fails_at_startup_with_the_fitting_length(tiny_llama, monkeypatch):
    path, hf_model = tiny_llama
    # 80 tokens' worth: five 16-token blocks, one of them the null block.
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(_kv_gib(hf_model, tokens=80)))
    with pytest.raises(exc.KVCacheTooSmallError, match="largest `max_model_len` that fits is 64"):
        LLM(model=str(path), max_model_len=128)


@pytest.mark.parametrize("tokens", [80, 200])
def test_the_kv_cache_takes_the_bytes_asked_and_never_more(tiny_llama, monkeypatch, tokens):
    path, hf_model = tiny_llama
    budget = _kv_gib(hf_model, tokens=tokens)
    monkeypatch.setenv("FERROLLM_CPU_KVCACHE_SPACE", str(budget))
    with LLM(model=str(path), max_model_len=64) as llm:
        kv_bytes = sum(t.numel() * t.element_size() for t in llm.llm_engine.runner.kv_caches)
    per_block = kv_bytes // (tokens // 16)
    assert kv_bytes <= budget * (1 << 30) < kv_bytes + per_block


def test_missing_model_says_how_to_pass_a_folder(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(exc.ConfigError, match="not in the Hugging Face cache.*local folder"):
        LLM(model="no-such-org/no-such-model")


def test_chat_renders_the_template(tiny_llama):
    path, _ = tiny_llama
    template = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    with LLM(model=str(path)) as llm:
        outs = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]],
                        greedy(3), use_tqdm=False, chat_template=template)
        tok = llm.get_tokenizer()
        expected = tok("<|user|>hi\n<|assistant|>", add_special_tokens=False)["input_ids"]
        assert outs[0].prompt_token_ids == expected
        assert len(outs) == 2


def test_close_is_idempotent_and_blocks_use(tiny_llama):
    path, _ = tiny_llama
    llm = LLM(model=str(path))
    llm.close()
    llm.close()
    with pytest.raises(RuntimeError, match="closed"):
        llm.generate(["a"], use_tqdm=False)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"dtype": "float8"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"max_num_batched_tokens": 8, "max_num_seqs": 16}, "max_num_batched_tokens"),
    ],
)
def test_invalid_engine_options_name_the_option(tiny_llama, kwargs, param):
    path, _ = tiny_llama
    with pytest.raises(exc.ConfigError, match=f"`{param}`"):
        LLM(model=str(path), **kwargs)


def with_generation_config(src: Path, dst: Path, **fields) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "generation_config.json").read_text())
    config.update(fields)
    (dst / "generation_config.json").write_text(json.dumps(config))
    return dst


def test_generation_config_supplies_the_defaults(tiny_llama, tmp_path):
    folder = with_generation_config(tiny_llama[0], tmp_path / "gen", temperature=0.0, top_k=20, top_p=0.8,
                                    repetition_penalty=1.3, max_new_tokens=5, do_sample=True)
    prompts = [{"prompt_token_ids": [5, 9, 14, 22]}]
    with LLM(model=str(folder)) as llm:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.max_tokens, defaults.repetition_penalty) == (0.0, 5, 1.3)
        auto = llm.generate(prompts, use_tqdm=False)[0].outputs[0]
        explicit = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=5, repetition_penalty=1.3),
                                use_tqdm=False)[0].outputs[0]
        # Parameters the user passes are used as given: no field comes from the file.
        plain = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
    assert auto.token_ids == explicit.token_ids and len(auto.token_ids) <= 5
    assert len(plain.token_ids) == 12
    with LLM(model=str(folder), generation_config="vllm") as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
    with LLM(model=str(tiny_llama[0]), generation_config=str(folder),
             override_generation_config={"max_new_tokens": 3}) as llm:
        assert llm.get_default_sampling_params().max_tokens == 3
        assert len(llm.generate(prompts, use_tqdm=False)[0].outputs[0].token_ids) <= 3
