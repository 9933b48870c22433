"""The vLLM engine options issue #27 asks to work (loading, tokenizer, statistics), on tiny
checkpoints."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from ferrollm import LLM, SamplingParams
from ferrollm.model_executor.dummy_weights import dummy_weights


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_metrics_are_none_by_default_as_in_vllm(tiny_llama):
    path, _ = tiny_llama
    with LLM(str(path)) as llm:
        out = llm.generate(["Hello world"], greedy(3), use_tqdm=False)
    assert out[0].metrics is None


def test_disable_log_stats_false_fills_request_state_stats(tiny_llama, monkeypatch, caplog):
    path, _ = tiny_llama
    monkeypatch.setenv("FERROLLM_LOG_STATS_INTERVAL", "0")
    with caplog.at_level(logging.INFO, logger="ferrollm.stats"), LLM(str(path), disable_log_stats=False) as llm:
        outs = llm.generate(["Hello world", "The end"], [greedy(4), SamplingParams(max_tokens=3, n=2, ignore_eos=True)],
                            use_tqdm=False)
    m = outs[0].metrics
    assert m.num_generation_tokens == 4 and m.num_preemptions == 0 and m.arrival_time > 0
    assert 0 < m.queued_ts <= m.scheduled_ts <= m.first_token_ts <= m.last_token_ts
    assert m.first_token_latency >= 0
    assert outs[1].metrics.num_generation_tokens == 6  # both of its n=2 sequences
    assert any("Avg generation throughput" in r.message for r in caplog.records)


def test_skip_tokenizer_init_takes_token_ids_and_returns_token_ids(tiny_llama):
    path, _ = tiny_llama
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2, detokenize=True)
    with LLM(str(path), skip_tokenizer_init=True) as llm:
        with pytest.raises(ValueError, match="Tokenizer not available when `skip_tokenizer_init=True`.*prompt 0"):
            llm.generate("abc", params, use_tqdm=False)
        with pytest.raises(ValueError, match="Tokenizer not available"):
            llm.get_tokenizer()
        out = llm.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0]
    with LLM(str(path)) as ref:
        expected = ref.generate({"prompt_token_ids": [1, 2, 3]}, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    assert completion.text == "" and list(completion.token_ids) == list(expected.outputs[0].token_ids)
    assert all(lp.decoded_token is None for step in completion.logprobs for lp in step.values())


def test_tokenizer_mode_slow_encodes_text_with_the_transformers_tokenizer(tiny_llama):
    path, _ = tiny_llama
    with LLM(str(path), tokenizer_mode="slow") as llm:
        tok = llm.get_tokenizer()
        out = llm.generate("Hello world", greedy(2), use_tqdm=False)[0]
        assert out.prompt_token_ids == tok("Hello world")["input_ids"]

        class Stub:  # shows which tokenizer encodes: the Python one, not the core's
            def __call__(self, texts, add_special_tokens=True):
                return {"input_ids": [[5, 6, 7] for _ in texts]}

        llm.llm_engine.tokenizers._hf = Stub()
        assert llm.generate("Hello world", greedy(1), use_tqdm=False)[0].prompt_token_ids == [5, 6, 7]


@pytest.mark.parametrize("mode", ["mistral", "deepseek_v32", "custom"])
def test_tokenizer_modes_other_than_hfs_are_refused(tiny_llama, mode):
    path, _ = tiny_llama
    with pytest.raises(ValueError, match=rf"`tokenizer_mode` must be one of \['auto', 'hf', 'slow'\].*'{mode}'"):
        LLM(str(path), tokenizer_mode=mode)


def _config_only(src: Path, dst: Path) -> Path:
    """A checkpoint folder without weight files: config.json and the tokenizer."""
    dst.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, dst / name)
    return dst


def test_load_format_dummy_needs_no_weight_files(tiny_llama, tmp_path):
    path, hf_model = tiny_llama
    folder = _config_only(path, tmp_path / "no-weights")
    with LLM(str(folder), load_format="dummy") as a, LLM(str(folder), load_format="dummy") as b:
        out = a.generate("Hello world", greedy(5), use_tqdm=False)[0]
        assert len(out.outputs[0].token_ids) == 5
        assert out.outputs[0].token_ids == b.generate("Hello world", greedy(5), use_tqdm=False)[0].outputs[0].token_ids
    stream = dict(dummy_weights(hf_model.config))
    assert {k: v.shape for k, v in stream.items()} == {k: p.shape for k, p in hf_model.named_parameters()}
    assert all(0 < t.abs().max() <= 1e-3 for t in stream.values())


def test_load_format_dummy_runs_a_pooling_model(tiny_bert, tmp_path):
    path, hf_model = tiny_bert
    folder = _config_only(path, tmp_path / "no-weights")
    with LLM(str(folder), load_format="dummy") as llm:
        (out,) = llm.embed(["Hello world"], use_tqdm=False)
    assert len(out.outputs.embedding) == hf_model.config.hidden_size


def test_load_format_dummy_refuses_a_quantized_checkpoint(tiny_llama, tmp_path):
    path, _ = tiny_llama
    folder = _config_only(path, tmp_path / "q")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="load_format='dummy'.*quantized checkpoint"):
        LLM(str(folder), load_format="dummy")


def test_download_dir_is_the_hub_cache_a_hub_id_is_found_in(tiny_llama, tmp_path, monkeypatch):
    import huggingface_hub.constants as c

    path, _ = tiny_llama
    repo = tmp_path / "downloads" / "models--tiny-org--dl-llama"  # huggingface_hub's cache layout
    shutil.copytree(path, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "empty-default-cache"))
    with pytest.raises(ValueError, match="only the local cache was searched"):
        LLM("tiny-org/dl-llama")
    with LLM("tiny-org/dl-llama", download_dir=str(tmp_path / "downloads")) as llm:
        assert len(llm.generate("Hello", greedy(2), use_tqdm=False)[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize("show", [True, False])
def test_use_tqdm_on_load_shows_a_bar_over_the_weight_files(tiny_llama, capfd, show):
    path, _ = tiny_llama
    capfd.readouterr()
    with LLM(str(path), use_tqdm_on_load=show):
        pass
    assert ("Loading safetensors checkpoint shards" in capfd.readouterr().err) == show


def test_hf_token_reaches_the_hub_download(tiny_llama, monkeypatch):
    import huggingface_hub

    path, _ = tiny_llama
    seen = {}

    def fake_snapshot_download(repo_id, **kw):
        seen.update(kw, repo_id=repo_id)
        return str(path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    with LLM("tiny-org/private-llama", hf_token="hf_secret", use_tqdm_on_load=False):
        pass
    assert seen["repo_id"] == "tiny-org/private-llama" and seen["token"] == "hf_secret"
