"""Images in `/v1/chat/completions`: OpenAI's `image_url` parts (a `data:` URL or a local path)
against a tiny Qwen2-VL server give the offline `LLM.chat` text for the same messages; the
multimodal limits and errors come back as OpenAI 400s."""

from __future__ import annotations

import base64
import io

import openai
import pytest
from ferrollm import LLM, SamplingParams
from helpers.server import start as _start
from helpers.vl_checkpoints import build_vl_checkpoint, random_image

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
            "{% else %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}assistant:")
GREEDY = {"max_tokens": 6, "temperature": 0.0}


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def vl_server(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("qwen2_vl_serve")
    build_vl_checkpoint("qwen2_vl", folder, tokenizer_dir)
    log = tmp_path_factory.mktemp("serve-vl") / "server.log"
    proc, url = _start(folder, log, "--served-model-name", "vl", "--chat-template", TEMPLATE,
                       "--max-model-len", "512", "--limit-mm-per-prompt", '{"image": 2}')
    yield folder, url
    proc.terminate()
    proc.wait(timeout=30)


def test_chat_with_image_url_parts_is_the_offline_chat(vl_server, tmp_path):
    folder, url = vl_server
    first, second = random_image(50, 56, 84), random_image(51, 84, 56)
    second.save(tmp_path / "second.png")
    content = [{"type": "text", "text": "look "}, {"type": "image_url", "image_url": {"url": _data_url(first)}},
               {"type": "text", "text": " and "},
               {"type": "image_url", "image_url": {"url": str(tmp_path / "second.png")}}]
    messages = [{"role": "user", "content": content}]
    with LLM(str(folder), max_model_len=512) as llm:
        want = llm.chat(messages, SamplingParams(**GREEDY), use_tqdm=False, chat_template=TEMPLATE)[0]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    got = client.chat.completions.create(model="vl", messages=messages, **GREEDY)
    assert got.choices[0].message.content == want.outputs[0].text
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)  # placeholders expanded
    streamed = client.chat.completions.create(model="vl", messages=messages, stream=True, **GREEDY)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == want.outputs[0].text


def test_image_errors_are_openai_400s(vl_server):
    _, url = vl_server
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    image = {"type": "image_url", "image_url": {"url": _data_url(random_image(52, 56, 56))}}
    cases = {
        "remote images are not fetched": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}],
        "limit": [image, image, image],  # limit_mm_per_prompt={"image": 2}
        "must be of type 'text' or 'image_url'": [{"type": "input_audio", "input_audio": {}}],
    }
    for expected, content in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="vl", messages=[{"role": "user", "content": content}], **GREEDY)
        assert expected in str(e.value), e.value
    # The server still answers after the bad requests.
    ok = client.chat.completions.create(model="vl", messages=[{"role": "user", "content": [image]}], **GREEDY)
    assert ok.choices[0].finish_reason == "length"
