"""The README's offline-inference example runs as written (on a tiny checkpoint)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers.checkpoints import MINILM_INSTALL, minilm_folder

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example(marker: str = "LLM(model=") -> str:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    return next(b for b in blocks if marker in b)


def test_readme_example_runs(tiny_llama, capsys):
    path, _ = tiny_llama
    code = readme_example().replace('"path/to/checkpoint"', repr(str(path)))
    exec(compile(code, str(README), "exec"), {})
    printed = capsys.readouterr().out
    assert printed.count("Prompt: ") == 2 and "Generated text: " in printed


@pytest.mark.skipif(minilm_folder() is None, reason=MINILM_INSTALL)
def test_readme_embedding_example_runs(capsys):
    code = readme_example("llm.embed(").replace('"path/to/embedding-model"', repr(str(minilm_folder())))
    exec(compile(code, str(README), "exec"), {})
    length, score = capsys.readouterr().out.split()
    assert int(length) == 384 and 0.5 < float(score) <= 1.0


def test_hub_id_resolves_from_the_local_cache(tiny_llama, tmp_path, monkeypatch):
    import shutil

    from ferrollm import LLM

    path, _ = tiny_llama
    # The layout huggingface_hub keeps: models--org--name/{refs/main, snapshots/<rev>/...}.
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    shutil.copytree(path, repo / "snapshots" / "abc123")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with LLM(model="tiny-org/tiny-llama") as llm:
        out = llm.generate(["hello"], use_tqdm=False)[0]
        assert out.prompt_token_ids[0] == llm.get_tokenizer().bos_token_id
        assert out.outputs[0].finish_reason in ("length", "stop")


def test_readme_image_example_runs(tmp_path, tokenizer_dir, capsys):
    from helpers.vl_checkpoints import build_vl_checkpoint, random_image

    folder = tmp_path / "qwen2_5_vl"
    build_vl_checkpoint("qwen2_5_vl", folder, tokenizer_dir)
    random_image(0, 56, 84).save(tmp_path / "image.png")
    code = readme_example("multi_modal_data").replace('"path/to/Qwen2.5-VL-3B-Instruct"', repr(str(folder)))
    code = code.replace('"path/to/image.png"', repr(str(tmp_path / "image.png")))
    exec(compile(code, str(README), "exec"), {})
    assert capsys.readouterr().out.strip()
