"""Qwen2-VL and Qwen2.5-VL with videos: tiny random checkpoints through `LLM.generate` match
transformers' processor and greedy `generate` (a video, an image and a video in one prompt, two
videos, PIL frames, a video with its fps), batched with a text request under chunked prefill
and prefix caching; M-RoPE positions equal to transformers' `get_rope_index`; the options
(`limit_mm_per_prompt`, `mm_processor_kwargs`, the input cache, the prefix cache keyed by
video content) and the refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from ferrollm import LLM, SamplingParams
from helpers.vl_checkpoints import build_vl_checkpoint, random_image
from helpers.vl_video import (
    hf_greedy_mm,
    hf_processor,
    random_video,
    save_video_processor,
    video_processor,
)

torch.set_num_threads(2)

MAX_TOKENS = 5
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vl(request, tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp(f"{request.param}_video")
    model = build_vl_checkpoint(request.param, folder, tokenizer_dir)
    save_video_processor(folder)
    return folder, model, hf_processor(folder, request.param)


@pytest.fixture(scope="module")
def qwen2_5_vl(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("qwen2_5_vl_video_options")
    model = build_vl_checkpoint("qwen2_5_vl", folder, tokenizer_dir)
    save_video_processor(folder)
    return folder, model, hf_processor(folder, "qwen2_5_vl")


def _llm(folder, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 512)
    return LLM(str(folder), **kwargs)


def _mm(images, videos) -> dict:
    return {k: v for k, v in (("image", images), ("video", videos)) if v}


def test_videos_match_transformers_batched_with_text(vl):
    folder, hf_model, processor = vl
    cases = [
        (f"see {VIDEO} now", [], [random_video(0, 4, 60, 90)]),
        (f"img {IMAGE} and vid {VIDEO} then", [random_image(1, 60, 90)], [random_video(2, 5, 120, 80)]),
        (f"two {VIDEO} vids {VIDEO}", [], [random_video(3, 6, 56, 56), random_video(4, 3, 70, 70)]),
        (f"frames {VIDEO} as images", [], [[random_image(5 + k, 70, 70) for k in range(3)]]),
    ]
    requests = [{"prompt": p, "multi_modal_data": _mm(i, v)} for p, i, v in cases] + ["a text request beside them"]
    # 16-token steps split the videos' placeholders across steps.
    with _llm(folder, max_num_batched_tokens=16, max_num_seqs=3, enable_prefix_caching=True) as llm:
        outs = llm.generate(requests, GREEDY, use_tqdm=False)
        for (prompt, images, videos), out in zip(cases, outs):
            ids, want = hf_greedy_mm(hf_model, processor, prompt, images, videos, MAX_TOKENS)
            assert list(out.prompt_token_ids) == ids, prompt
            assert list(out.outputs[0].token_ids) == want, prompt


def test_a_video_with_its_fps_matches_transformers(qwen2_5_vl):
    folder, hf_model, processor = qwen2_5_vl
    video = random_video(6, 8, 56, 84)
    prompt = f"timed {VIDEO} clip"
    with _llm(folder) as llm:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"video": (video, {"fps": 2})}}, GREEDY,
                           use_tqdm=False)
    ids, want = hf_greedy_mm(hf_model, processor, prompt, [], [video], MAX_TOKENS,
                             video_metadata=[{"fps": 2, "total_num_frames": 8}])
    assert list(out[0].prompt_token_ids) == ids
    assert list(out[0].outputs[0].token_ids) == want


@pytest.mark.parametrize("fps", [None, 2, 0.7])
def test_mrope_positions_equal_transformers_get_rope_index(qwen2_5_vl, fps):
    folder, hf_model, processor = qwen2_5_vl
    image, video = random_image(7, 56, 84), random_video(8, 8, 84, 56)
    prompt = f"a {IMAGE} b {VIDEO} c"
    metadata = {"video_metadata": [{"fps": fps, "total_num_frames": 8}]} if fps else {}
    with _llm(folder) as llm:
        model = llm.llm_engine.generation_runner.model
        ids = llm.llm_engine.tokenizers.core.encode(prompt)
        data = {"image": image, "video": (video, {"fps": fps}) if fps else video}
        inputs = llm.llm_engine.mm_processor.process(ids, data)
        got, delta = model.mrope_positions(len(inputs.prompt_token_ids), inputs.items)
    hf = processor(text=[prompt], images=[image], videos=[video], return_tensors="pt", **metadata)
    want, want_delta = hf_model.model.get_rope_index(
        hf["input_ids"], hf["mm_token_type_ids"], hf["image_grid_thw"], hf["video_grid_thw"],
        hf["second_per_grid_ts"])
    assert inputs.prompt_token_ids == hf["input_ids"][0].tolist()
    assert np.array_equal(got, want[:, 0].numpy()) and delta == int(want_delta)
    if fps == 2:  # 2 frames a group at 2 fps: one second, 2 tokens_per_second apart
        assert got[0].max() - got[0][inputs.items[1].offset] == 3 * hf_model.config.vision_config.tokens_per_second


def test_prompt_token_ids_and_expanded_runs(qwen2_5_vl):
    folder, hf_model, processor = qwen2_5_vl
    image, video = random_image(9, 56, 56), random_video(10, 4, 56, 84)
    prompt = f"{VIDEO} first, then {IMAGE}"
    ids, want = hf_greedy_mm(hf_model, processor, prompt, [image], [video], MAX_TOKENS)
    with _llm(folder) as llm:
        bare = llm.llm_engine.tokenizers.core.encode(prompt)
        for prompt_ids in (bare, ids):  # one placeholder per item, or transformers' expanded runs
            out = llm.generate({"prompt_token_ids": prompt_ids, "multi_modal_data": {"image": image, "video": video}},
                               GREEDY, use_tqdm=False)
            assert list(out[0].prompt_token_ids) == ids
            assert list(out[0].outputs[0].token_ids) == want


def test_limits_and_placeholder_mismatches_are_refused(qwen2_5_vl):
    folder, _, _ = qwen2_5_vl
    video, image = random_video(11, 2, 56, 56), random_image(12, 56, 56)

    def run(llm, prompt, **data):
        return llm.generate({"prompt": prompt, "multi_modal_data": data}, GREEDY, use_tqdm=False)

    with _llm(folder, limit_mm_per_prompt={"image": 2, "video": 1}) as llm:
        with pytest.raises(ValueError, match=r"At most 1 video.*limit_mm_per_prompt\['video'\]=1.*Given: 2"):
            run(llm, VIDEO * 2, video=[video, video])
        with pytest.raises(ValueError, match=r"2 video placeholder token\(s\).*has 1 video\(s\)"):
            run(llm, VIDEO * 2, video=video)
        with pytest.raises(ValueError, match=r"1 video placeholder token\(s\).*has 0 video\(s\)"):
            run(llm, IMAGE + VIDEO, image=image)
        with pytest.raises(ValueError, match=r"must be a video \(a list of PIL images.*Given: ndarray of shape"):
            run(llm, VIDEO, video=np.zeros((56, 56, 3), np.uint8))
        with pytest.raises(ValueError, match=r"keys must be one of \['image', 'video'\].*Given: 'audio'"):
            run(llm, "x", audio=[1])
        assert len(run(llm, IMAGE * 2 + VIDEO, image=[image, image], video=[video])[0].outputs[0].token_ids)
    with _llm(folder, limit_mm_per_prompt={"video": 0}) as llm:
        assert llm.llm_engine.generation_runner.model.visual is not None  # images still come
        with pytest.raises(ValueError, match=r"At most 0 video.*Given: 1"):
            run(llm, VIDEO, video=video)
        assert len(run(llm, IMAGE, image=image)[0].outputs[0].token_ids) == MAX_TOKENS


def _num_video_tokens(llm: LLM, video, **request_kwargs) -> int:
    prompt = {"prompt": VIDEO, "multi_modal_data": {"video": video}}
    if request_kwargs:
        prompt["mm_processor_kwargs"] = request_kwargs
    out = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False)
    return list(out[0].prompt_token_ids).count(llm.llm_engine.model_config.hf_config.video_token_id)


def _hf_video_tokens(video, **kwargs) -> int:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the bare min/max_pixels keys, as vLLM passes them
        grid = video_processor()(videos=[video], return_tensors="pt", **kwargs)["video_grid_thw"][0]
    return int(grid.prod()) // 4


def test_mm_processor_kwargs_change_the_video_token_count_as_transformers_does(qwen2_5_vl):
    folder, _, _ = qwen2_5_vl
    video = random_video(13, 6, 200, 300)
    small = dict(max_pixels=28 * 28 * 6)
    with _llm(folder, mm_processor_kwargs=small) as llm:
        assert _num_video_tokens(llm, video) == _hf_video_tokens(video, **small) < _hf_video_tokens(video)
        # A request's own options win; the video processor's own keys (frame sampling) reach it.
        sample = dict(do_sample_frames=True, num_frames=2)
        assert _num_video_tokens(llm, video, **sample) == _hf_video_tokens(video, **small, **sample)
        with pytest.raises(ValueError, match=r"accepts: \[.*'fps'.*Given: \['fpz'\]"):
            _num_video_tokens(llm, video, fpz=1)
        with pytest.raises(ValueError, match="refused the video.*metadata"):
            _num_video_tokens(llm, video, do_sample_frames=True, fps=1)  # fps sampling needs the video's fps


def test_input_cache_hits_on_a_repeated_video(qwen2_5_vl):
    folder, _, _ = qwen2_5_vl
    video = random_video(14, 4, 56, 56)
    with _llm(folder) as llm:
        cache = llm.llm_engine.mm_processor.cache
        _num_video_tokens(llm, video)
        _num_video_tokens(llm, _frames(video))  # PIL frames are other content to the hash
        _num_video_tokens(llm, video.copy())
        assert cache.stats()["num_hits"] == 1
        _num_video_tokens(llm, (video, {"fps": 2}))  # other metadata: other positions
        _num_video_tokens(llm, video, max_pixels=28 * 28 * 8)  # other options
        assert cache.stats()["num_hits"] == 1 and cache.stats()["num_entries"] == 4


def _frames(video):
    from PIL import Image

    return [Image.fromarray(f) for f in video]


def test_prefix_cache_reuses_a_repeated_video_but_not_a_different_one(qwen2_5_vl):
    folder, _, _ = qwen2_5_vl
    prompt = f"a shared text prefix long enough to fill a whole block of sixteen tokens {VIDEO} and then"
    same, other = random_video(15, 4, 112, 112), random_video(16, 4, 112, 112)
    with _llm(folder, block_size=16) as llm:
        def run(video):
            return llm.generate({"prompt": prompt, "multi_modal_data": {"video": video}}, GREEDY, use_tqdm=False)[0]

        first = run(same)
        ids = list(first.prompt_token_ids)
        video_id = llm.llm_engine.model_config.hf_config.video_token_id
        offset, end = ids.index(video_id), ids.index(video_id) + ids.count(video_id)
        repeat, different = run(same), run(other)
        assert repeat.num_cached_tokens >= end // 16 * 16 > offset
        assert list(repeat.outputs[0].token_ids) == list(first.outputs[0].token_ids)
        assert different.num_cached_tokens == offset // 16 * 16


def test_chat_refuses_video_url_parts(qwen2_5_vl):
    folder, _, _ = qwen2_5_vl
    messages = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "file:///clip.mp4"}}]}]
    with _llm(folder) as llm, pytest.raises(ValueError, match=r"`video_url`.*no video decoder.*'video': frames"):
        llm.chat(messages, GREEDY, use_tqdm=False, chat_template="{{ messages }}")


def test_readme_video_example_runs(qwen2_5_vl, tmp_path, capsys):
    import re
    from pathlib import Path

    folder, _, _ = qwen2_5_vl
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if '"video"' in b)
    np.save(tmp_path / "frames.npy", random_video(17, 4, 56, 84))
    code = code.replace('"path/to/Qwen2.5-VL-3B-Instruct"', repr(str(folder)))
    code = code.replace('"path/to/frames.npy"', repr(str(tmp_path / "frames.npy")))
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip()
