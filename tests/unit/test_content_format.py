"""`chat_template_content_format`: "auto" reads whether a chat template loops over a message's
content parts; "string" joins each message's parts, the model's placeholder per item first."""

from __future__ import annotations

import pytest

from ferrollm.exceptions import InvalidRequestError
from ferrollm.multimodal.content_format import detect_content_format, join_parts, resolve_content_format

LOOPS = "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}"
VIA_NAME = "{% for m in messages %}{% set c = m.content %}{% for p in c %}{{ p }}{% endfor %}{% endfor %}"
PRINTS = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize(("template", "fmt"), [(LOOPS, "openai"), (VIA_NAME, "openai"), (PRINTS, "string"),
                                               (None, "openai"), ("{% for %}", "openai")])
def test_auto_reads_the_template(template, fmt):
    assert detect_content_format(template) == fmt
    assert resolve_content_format("auto", template) == fmt
    assert resolve_content_format("string", template) == "string"


def test_parts_join_placeholders_first_then_the_texts():
    conv = [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "compare"}, {"type": "image"},
                                         {"type": "text", "text": "with"}, {"type": "image"}]}]
    out = join_parts(conv, {"image": "<image>"})
    assert out == [conv[0], {"role": "user", "content": "<image>\n<image>\ncompare\nwith"}]
    # An empty placeholder (Fuyu: its processor lays the image out) leaves the text alone.
    assert join_parts(conv[1:], {"image": ""})[0]["content"] == "compare\nwith"


def test_unknown_parts_and_formats_are_refused():
    with pytest.raises(InvalidRequestError, match=r"must be text or one of \['image'\].*Given: 'video'"):
        join_parts([{"role": "user", "content": [{"type": "video"}]}], {"image": "<image>"})
    with pytest.raises(InvalidRequestError, match=r"one of \['auto', 'string', 'openai'\]. Given: 'jinja'"):
        resolve_content_format("jinja", PRINTS)
