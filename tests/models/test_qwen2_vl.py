"""Qwen2-VL and Qwen2.5-VL: tiny random checkpoints with images through `LLM.generate` match
transformers' greedy tokens and log-probabilities (one image, two images, batched with a text
request, chunked prefill splitting an image, prefix caching on); the multimodal options
(`limit_mm_per_prompt`, `mm_processor_kwargs`, the input cache) and the prefix cache keyed by
image content."""

from __future__ import annotations

import pytest
import torch
from ferrollm import LLM, SamplingParams
from helpers.vl_checkpoints import (
    assert_matches_greedy,
    build_vl_checkpoint,
    hf_greedy_vl,
    image_processor,
    random_image,
)

torch.set_num_threads(2)

MAX_TOKENS = 6
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request, tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp(request.param)
    return folder, build_vl_checkpoint(request.param, folder, tokenizer_dir)


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("qwen2_vl_options")
    return folder, build_vl_checkpoint("qwen2_vl", folder, tokenizer_dir)


def _llm(folder, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 512)
    return LLM(str(folder), **kwargs)


def _check_against_transformers(llm: LLM, hf_model, prompts: list[tuple[str, list]]) -> None:
    tok = llm.llm_engine.tokenizers.core
    requests = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in prompts]
    outs = llm.generate(requests, GREEDY, use_tqdm=False)
    for (prompt, images), out in zip(prompts, outs):
        want, logits = hf_greedy_vl(hf_model, tok.encode(prompt), images, MAX_TOKENS)
        assert_matches_greedy(out, want, logits, prompt)


def test_images_match_transformers_batched_with_text(vl):
    folder, hf_model = vl
    small, wide = random_image(0, 60, 90), random_image(1, 120, 200)
    prompts = [
        (f"describe {IMAGE} now", [small]),
        (f"two {IMAGE} and {IMAGE} compared", [wide, small]),
        ("plain text request without images", []),
    ]
    with _llm(folder) as llm:
        _check_against_transformers(llm, hf_model, prompts)


def test_chunked_prefill_splits_an_image_and_still_matches(vl):
    folder, hf_model = vl
    # 16-token steps cut the image's 24 placeholders across two steps.
    with _llm(folder, max_num_batched_tokens=16, max_num_seqs=2, enable_prefix_caching=True) as llm:
        _check_against_transformers(llm, hf_model, [(f"look {IMAGE} here", [random_image(2, 150, 200)]),
                                                    ("and a text request beside it", [])])


def test_two_ranks_match_transformers(qwen2_vl):
    # The driver encodes and sends the workers the M-RoPE positions and image embeddings
    # (worker/mm_broadcast.py); a 24-token budget splits the image across steps.
    folder, hf_model = qwen2_vl
    prompts = [(f"look{IMAGE} here", [random_image(3, 64, 92)]), ("text only beside it", [])]
    with _llm(folder, tensor_parallel_size=2, max_num_batched_tokens=24, max_num_seqs=2) as llm:
        _check_against_transformers(llm, hf_model, prompts)


def test_prompt_token_ids_with_one_placeholder_per_image(qwen2_vl):
    folder, hf_model = qwen2_vl
    with _llm(folder) as llm:
        ids = llm.llm_engine.tokenizers.core.encode(f"see {IMAGE} it")
        image = random_image(3, 56, 84)
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [image]}}, GREEDY, use_tqdm=False)
        want, _ = hf_greedy_vl(hf_model, ids, [image], MAX_TOKENS)
        assert list(out[0].outputs[0].token_ids) == want
        # The same prompt with its placeholders already expanded is accepted as is.
        expanded = list(out[0].prompt_token_ids)
        again = llm.generate({"prompt_token_ids": expanded, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
        assert list(again[0].outputs[0].token_ids) == want


def test_placeholder_mismatch_names_both_counts(qwen2_vl):
    folder, _ = qwen2_vl
    with _llm(folder) as llm:
        with pytest.raises(ValueError, match=r"1 image placeholder.*2 image\(s\)"):
            llm.generate({"prompt": f"one {IMAGE}", "multi_modal_data": {"image": [random_image(0, 56, 56)] * 2}},
                         GREEDY, use_tqdm=False)
        with pytest.raises(ValueError, match=r"keys must be one of \['image', 'video'\].*Given: 'audio'"):
            llm.generate({"prompt": "x", "multi_modal_data": {"audio": [1]}}, GREEDY, use_tqdm=False)


def test_limit_mm_per_prompt_refuses_extra_images(qwen2_vl):
    folder, _ = qwen2_vl
    image = random_image(0, 56, 56)
    with _llm(folder, limit_mm_per_prompt={"image": 1}) as llm:
        with pytest.raises(ValueError, match=r"At most 1 image.*limit_mm_per_prompt\['image'\]=1.*Given: 2"):
            llm.generate({"prompt": f"{IMAGE}{IMAGE}", "multi_modal_data": {"image": [image, image]}},
                         GREEDY, use_tqdm=False)


def test_zero_limit_skips_the_vision_tower(qwen2_vl):
    folder, hf_model = qwen2_vl
    with _llm(folder, limit_mm_per_prompt={"image": 0, "video": 0}) as llm:
        model = llm.llm_engine.generation_runner.model
        assert model.visual is None
        assert not any(name.startswith("visual") for name, _ in model.named_parameters())
        with pytest.raises(ValueError, match=r"At most 0 image.*Given: 1"):
            llm.generate({"prompt": IMAGE, "multi_modal_data": {"image": random_image(0, 56, 56)}},
                         GREEDY, use_tqdm=False)
        _check_against_transformers(llm, hf_model, [("text still works", [])])


def test_language_model_only_skips_the_vision_tower(qwen2_vl):
    folder, _ = qwen2_vl
    with _llm(folder, language_model_only=True) as llm:
        assert llm.llm_engine.generation_runner.model.visual is None
        with pytest.raises(ValueError, match=r"At most 0 image"):
            llm.generate({"prompt": IMAGE, "multi_modal_data": {"image": random_image(0, 56, 56)}},
                         GREEDY, use_tqdm=False)


def _num_image_tokens(llm: LLM, image, **request_kwargs) -> int:
    prompt = {"prompt": IMAGE, "multi_modal_data": {"image": image}}
    if request_kwargs:
        prompt["mm_processor_kwargs"] = request_kwargs
    out = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    image_id = llm.llm_engine.model_config.hf_config.image_token_id
    return sum(t == image_id for t in out[0].prompt_token_ids)


def _hf_tokens(image, **kwargs) -> int:
    """Image tokens when transformers' processor gets ``kwargs`` at call time, as vLLM passes
    `mm_processor_kwargs` (transformers deprecates the bare min/max_pixels keys there)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        grid = image_processor()(images=[image], return_tensors="pt", **kwargs)["image_grid_thw"][0]
    return int(grid.prod()) // 4


def test_mm_processor_kwargs_change_the_token_count_as_transformers_does(qwen2_vl):
    folder, _ = qwen2_vl
    image = random_image(4, 300, 400)
    with _llm(folder, mm_processor_kwargs={"max_pixels": 28 * 28 * 6}) as llm:
        assert _num_image_tokens(llm, image) == _hf_tokens(image, max_pixels=28 * 28 * 6) < _hf_tokens(image)
        # A request's own kwargs win over the LLM's.
        assert _num_image_tokens(llm, image, max_pixels=28 * 28 * 20) == _hf_tokens(image, max_pixels=28 * 28 * 20)
        small, grow = random_image(5, 56, 56), dict(min_pixels=28 * 28 * 16, max_pixels=28 * 28 * 64)
        assert _num_image_tokens(llm, small, **grow) == _hf_tokens(small, **grow) > _hf_tokens(small)
        with pytest.raises(ValueError, match="max_pixels"):
            _num_image_tokens(llm, image, max_pixelz=5)
    with pytest.raises(ValueError, match="mm_processor_kwargs.*min_pixels"):
        _llm(folder, mm_processor_kwargs={"bogus": 1})


def test_an_image_beyond_the_encoder_budget_is_refused(qwen2_vl):
    folder, _ = qwen2_vl
    # The budget is max(max_num_batched_tokens, the largest image the LLM's options allow: 32;
    # videos, allowed, would raise it to their own bound).
    with _llm(folder, max_num_batched_tokens=16, max_num_seqs=2, limit_mm_per_prompt={"video": 0}) as llm:
        big = random_image(6, 400, 400)
        with pytest.raises(ValueError, match=r"max_num_encoder_input_tokens \(32\)"):
            _num_image_tokens(llm, big, max_pixels=28 * 28 * 100)
        assert _num_image_tokens(llm, big) <= 32


def test_input_cache_hits_on_a_repeated_image_and_stays_under_its_cap(qwen2_vl, monkeypatch):
    folder, _ = qwen2_vl
    images = [random_image(10 + i, 112, 112) for i in range(3)]
    # One 112x112 image is 64 patches of 1176 floats: ~301 KB. The cap holds two.
    cap_gib = 700_000 / (1 << 30)
    with _llm(folder, mm_processor_cache_gb=cap_gib) as llm:
        cache = llm.llm_engine.mm_processor.cache
        _num_image_tokens(llm, images[0])
        _num_image_tokens(llm, images[0])
        assert cache.stats()["num_hits"] == 1
        for image in images:
            _num_image_tokens(llm, image)
            assert cache.stats()["num_bytes"] <= cache.stats()["capacity_bytes"]
        assert cache.stats()["num_evictions"] >= 1
    monkeypatch.setenv("FERROLLM_MM_INPUT_CACHE_GIB", "0")
    with _llm(folder) as llm:
        cache = llm.llm_engine.mm_processor.cache
        _num_image_tokens(llm, images[0])
        _num_image_tokens(llm, images[0])
        assert cache.stats()["num_hits"] == 0 and cache.stats()["num_entries"] == 0


def test_prefix_cache_reuses_a_repeated_image_but_not_a_different_one(qwen2_vl):
    folder, _ = qwen2_vl
    prefix = "a shared text prefix long enough to fill a whole block of sixteen tokens "
    prompt = f"{prefix}{IMAGE} and then"
    same, other = random_image(20, 112, 112), random_image(21, 112, 112)
    with _llm(folder, block_size=16) as llm:
        def run(image):
            out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)
            return out[0]

        first = run(same)
        image_id = llm.llm_engine.model_config.hf_config.image_token_id
        ids = list(first.prompt_token_ids)
        offset = ids.index(image_id)
        end = offset + ids.count(image_id)
        repeat, different = run(same), run(other)
        assert repeat.num_cached_tokens >= end // 16 * 16 > offset
        assert list(repeat.outputs[0].token_ids) == list(first.outputs[0].token_ids)
        # Blocks that hold any of the other image's placeholders must not be reused.
        assert different.num_cached_tokens == offset // 16 * 16


# Renders content parts as Qwen2-VL's template does: the image part becomes its placeholder.
PARTS_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {% for p in m['content'] %}"
                  "{% if p['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
                  "{% else %}{{ p['text'] }}{% endif %}{% endfor %}\n{% endfor %}assistant:")


def test_chat_takes_image_url_and_image_pil_parts(qwen2_vl, tmp_path):
    import base64
    import io

    folder, _ = qwen2_vl
    first, second = random_image(30, 56, 84), random_image(31, 84, 56)
    buf = io.BytesIO()
    first.save(buf, format="PNG")
    data_url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    second.save(tmp_path / "second.png")
    text = "user: look <|vision_start|><|image_pad|><|vision_end|> and <|vision_start|><|image_pad|><|vision_end|>\nassistant:"
    with _llm(folder) as llm:
        # The chat template carries the special tokens itself: no BOS is added.
        ids = llm.llm_engine.tokenizers.core.encode(text, add_special_tokens=False)
        want = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [first, second]}}, GREEDY,
                            use_tqdm=False)
        pil_or_url = [{"type": "image_url", "image_url": {"url": data_url}},
                      {"type": "image_url", "image_url": {"url": str(tmp_path / "second.png")}}]
        messages = [{"role": "user", "content": [{"type": "text", "text": "look "}, pil_or_url[0],
                                                 {"type": "text", "text": " and "}, pil_or_url[1]]}]
        got = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE)
        assert list(got[0].outputs[0].token_ids) == list(want[0].outputs[0].token_ids)
        messages[0]["content"][3] = {"type": "image_pil", "image_pil": second}
        got = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE)
        assert list(got[0].outputs[0].token_ids) == list(want[0].outputs[0].token_ids)
        with pytest.raises(ValueError, match="remote images are not fetched"):
            llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}],
                     GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE)


def test_preempted_image_requests_recompute_and_still_match(qwen2_vl, monkeypatch):
    folder, hf_model = qwen2_vl
    # KV room for ~96 tokens (2 layers x 2 KV heads x 16 dims, fp32) against four ~40-token
    # prompts growing by 6: the scheduler must preempt, and a resumed request re-encodes its image.
    per_token = 2 * 2 * 2 * 16 * 4
    monkeypatch.setenv("FERROLLM_CPU_KVCACHE_SPACE", str(96 * per_token / (1 << 30)))
    prompts = [(f"image {i} {IMAGE} what", [random_image(40 + i, 84, 84)]) for i in range(4)]
    with _llm(folder, max_model_len=64, block_size=4) as llm:
        _check_against_transformers(llm, hf_model, prompts)
        assert llm.llm_engine.core.stats()["num_preemptions"] > 0


def test_chat_uses_the_processor_chat_template_file(qwen2_vl, tmp_path):
    import json
    import shutil

    folder, _ = qwen2_vl
    copy = tmp_path / "with-template"
    shutil.copytree(folder, copy)
    (copy / "chat_template.json").write_text(json.dumps({"chat_template": PARTS_TEMPLATE}))
    messages = [{"role": "user", "content": [{"type": "text", "text": "see "},
                                             {"type": "image_pil", "image_pil": random_image(32, 56, 56)}]}]
    with _llm(copy) as llm:
        out = llm.chat(messages, GREEDY, use_tqdm=False)
        image_id = llm.llm_engine.model_config.hf_config.image_token_id
        assert image_id in out[0].prompt_token_ids and out[0].prompt.startswith("user: see <|vision_start|>")
