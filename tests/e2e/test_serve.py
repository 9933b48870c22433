"""`ferrollm serve`: a real server process on 127.0.0.1 with a tiny checkpoint, driven by the
official `openai` client (and plain HTTP for the non-OpenAI routes)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from ferrollm import LLM, SamplingParams
from helpers.server import get as _get
from helpers.server import start as _start

KEY = "test-key"
TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
PROMPTS = ["Hello world, the quick", "The end. More text", "Numbers 12345 and"]


def _post(url: str, body: dict, key: str | None = KEY) -> tuple[int, dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def server_log(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("serve") / "server.log"


@pytest.fixture(scope="module")
def server(tiny_llama, server_log):
    proc, url = _start(tiny_llama[0], server_log, "--served-model-name", "tiny", "--api-key", KEY,
                       "--chat-template", TEMPLATE, "--max-model-len", "128")
    yield url
    proc.terminate()
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    with LLM(model=str(tiny_llama[0]), max_model_len=128) as llm:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        return ([o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)],
                llm.chat([{"role": "user", "content": "Hello world"}], params, use_tqdm=False,
                         chat_template=TEMPLATE)[0].outputs[0].text)


GREEDY = {"max_tokens": 8, "temperature": 0.0, "extra_body": {"ignore_eos": True}}


def test_models_health_version(server):
    status, body = _get(server + "/v1/models", KEY)
    assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == ["tiny"]
    assert _get(server + "/health")[0] == 200
    assert "version" in json.loads(_get(server + "/version")[1])


def test_completion_is_the_offline_greedy_text_whole_and_streamed(server, client, offline):
    texts, _ = offline
    out = client.completions.create(model="tiny", prompt=PROMPTS, **GREEDY)
    assert [c.text for c in sorted(out.choices, key=lambda c: c.index)] == texts
    assert out.usage.completion_tokens == 8 * len(PROMPTS) and out.choices[0].finish_reason == "length"
    counts = [_post(server + "/tokenize", {"model": "tiny", "prompt": p})[1]["count"] for p in PROMPTS]
    assert out.usage.prompt_tokens == sum(counts)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[0], stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == texts[0]
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.prompt_tokens == counts[0]
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], logprobs=2, **GREEDY).choices[0].logprobs
    assert len(whole.tokens) == 8 and all(1 <= len(t) <= 3 for t in whole.top_logprobs)  # keyed by text: may collide
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model="tiny", prompt=PROMPTS[0], logprobs=2, stream=True, **GREEDY)]
    assert sum((lp.token_logprobs for lp in streamed), []) == pytest.approx(whole.token_logprobs, abs=1e-5)


def test_chat_whole_and_streamed(client, offline):
    _, chat_text = offline
    messages = [{"role": "user", "content": "Hello world"}]
    out = client.chat.completions.create(model="tiny", messages=messages, logprobs=True, top_logprobs=2, **GREEDY)
    choice = out.choices[0]
    assert choice.message.content == chat_text and choice.message.role == "assistant"
    assert len(choice.logprobs.content) == 8 and all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    stream = client.chat.completions.create(model="tiny", messages=messages, stream=True, **GREEDY)
    chunks = [c for c in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat_text
    streamed = client.chat.completions.create(model="tiny", messages=messages, stream=True, logprobs=True,
                                              top_logprobs=1, **GREEDY)
    tokens = [t for c in streamed for t in c.choices[0].logprobs.content]
    assert [t.logprob for t in tokens] == pytest.approx([t.logprob for t in choice.logprobs.content], abs=1e-5)


def test_n_seed_stop_and_max_completion_tokens(client):
    kw = {"model": "tiny", "prompt": PROMPTS[0], "n": 2, "temperature": 1.0, "seed": 5, "max_tokens": 6}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                         max_completion_tokens=3, temperature=0.0)
    assert out.usage.completion_tokens <= 3
    first = client.completions.create(model="tiny", prompt=PROMPTS[1], **GREEDY).choices[0].text
    if len(first) > 2:
        stopped = client.completions.create(model="tiny", prompt=PROMPTS[1], stop=[first[1:3]], **GREEDY)
        assert stopped.choices[0].finish_reason == "stop" and first[1:3] not in stopped.choices[0].text


def test_errors_are_openai_json(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", n=0)
    assert e.value.body["param"] == "n" and e.value.body["type"] == "BadRequestError"
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=10, extra_body={"top_p": 7})
    with pytest.raises(openai.BadRequestError):  # longer than max_model_len
        client.completions.create(model="tiny", prompt=list(range(5, 200)), max_tokens=4)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    status, body = _post(server + "/v1/completions", {"prompt": "x"}, key=None)
    assert status == 401 and body["error"]["type"] == "AuthenticationError"
    assert _get(server + "/health")[0] == 200


def test_concurrent_requests_get_their_own_answers(server, offline):
    texts, _ = offline

    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
        calls = [client.completions.create(model="tiny", prompt=PROMPTS[i % 3], **GREEDY) for i in range(12)]
        return await asyncio.gather(*calls)

    outs = asyncio.run(main())
    assert [o.choices[0].text for o in outs] == [texts[i % 3] for i in range(12)]


def test_disconnect_mid_stream_aborts_its_request(server, client, server_log):
    # Eight sequences of 100 tokens: the tiny model's steps end in one Rust call each (sampling
    # included), and one sequence alone could finish before the server hears of the disconnect.
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 100, "n": 8, "stream": True, "ignore_eos": True}
    req = urllib.request.Request(server + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.readline().startswith(b"data: ")
    deadline = time.time() + 10
    while "aborted request cmpl-" not in server_log.read_text() and time.time() < deadline:
        time.sleep(0.1)
    assert "aborted request cmpl-" in server_log.read_text()
    assert client.completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY).choices[0].finish_reason == "length"


def test_tokenize_detokenize(server):
    status, body = _post(server + "/tokenize", {"prompt": "Hello world"})
    assert status == 200 and body["count"] == len(body["tokens"]) and body["max_model_len"] == 128
    status, back = _post(server + "/detokenize", {"tokens": body["tokens"]})
    assert status == 200 and "Hello world" in back["prompt"]


def test_metrics_count_requests_and_return_to_idle(server, client):
    client.completions.create(model="tiny", prompt=PROMPTS[0], **GREEDY)
    status, text = _get(server + "/metrics")
    body = text.decode()
    assert status == 200
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prefix_cache_hits_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_count"):
        assert name in body
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
              if line.startswith("vllm:") and "{" in line}
    assert values["vllm:num_requests_running"] == 0 and values["vllm:kv_cache_usage_perc"] == 0
    assert values["vllm:generation_tokens_total"] >= 8


# The bounded load test is 500 streams; the default run's 60 exercise the same paths
# (several steps' worth of waiting requests, aborts landing between steps).
@pytest.mark.parametrize("streams", [60, pytest.param(500, marks=pytest.mark.slow)])
def test_many_streams_some_leaving_early_all_whole_and_blocks_freed(server, offline, streams):
    texts, _ = offline

    async def one(client, i):
        stream = await client.completions.create(model="tiny", prompt=PROMPTS[i % 3], stream=True, **GREEDY)
        parts = []
        async for chunk in stream:
            parts.append(chunk.choices[0].text)
            if i % 3 == 2:  # a third of the clients leave after their first chunk
                break
        await stream.close()
        return "".join(parts)

    async def main():
        client = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)
        return await asyncio.gather(*[one(client, i) for i in range(streams)])

    for i, text in enumerate(asyncio.run(main())):
        if i % 3 != 2:
            assert text == texts[i % 3]
    deadline = time.time() + 10
    while time.time() < deadline:  # the aborts reach the step thread between steps
        body = _get(server + "/metrics")[1].decode()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                  if line.startswith("vllm:") and "{" in line}
        if values["vllm:num_requests_running"] + values["vllm:num_requests_waiting"] == 0:
            break
        time.sleep(0.1)
    assert values["vllm:kv_cache_usage_perc"] == 0 and values["vllm:num_requests_running"] == 0
    assert _get(server + "/health")[0] == 200


def test_embeddings_from_a_pooling_model(tiny_bert, tmp_path):
    import numpy as np

    from ferrollm import LLM

    proc, url = _start(tiny_bert[0], tmp_path / "bert.log", "--served-model-name", "bert")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        inputs = ["Hello world", "The end."]
        as_b64 = client.embeddings.create(model="bert", input=inputs)  # the client asks for base64
        as_float = client.embeddings.create(model="bert", input=inputs, encoding_format="float")
        assert as_float.usage.prompt_tokens > 0
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="bert", prompt="x", max_tokens=1)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    with LLM(model=str(tiny_bert[0])) as llm:
        want = [o.outputs.embedding for o in llm.embed(inputs, use_tqdm=False)]
    for got_b64, got_float, w in zip(as_b64.data, as_float.data, want):
        np.testing.assert_allclose(got_b64.embedding, w, atol=1e-5)
        np.testing.assert_allclose(got_float.embedding, w, atol=1e-5)
