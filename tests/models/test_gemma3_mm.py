"""Gemma 3 with images: a tiny random ``Gemma3ForConditionalGeneration`` through `LLM.generate`
matches transformers' greedy tokens and log-probabilities (one image, two images, batched with
a text request, prefix caching on, a step budget that would split an image), which needs the
bidirectional attention inside each image; the prompt is expanded as ``Gemma3Processor``
expands it; `limit_mm_per_prompt={"image": 0}` skips the vision tower."""

from __future__ import annotations

import logging

import pytest
import torch
from ferrollm import LLM, SamplingParams
from helpers.checkpoints import rewritten_checkpoint
from helpers.gemma3_checkpoints import build_gemma3_checkpoint, hf_greedy_gemma3
from helpers.vl_checkpoints import assert_matches_greedy, random_image

torch.set_num_threads(2)

MAX_TOKENS = 5
IMAGE = "<start_of_image>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("gemma3_mm")
    model, processor = build_gemma3_checkpoint(folder, tokenizer_dir)
    return folder, model, processor


def _check_against_transformers(llm: LLM, hf_model, processor, prompts: list[tuple[str, list]],
                                **processor_kwargs) -> None:
    requests = [{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in prompts]
    outs = llm.generate(requests, GREEDY, use_tqdm=False)
    for (prompt, images), out in zip(prompts, outs):
        ids, want, logits = hf_greedy_gemma3(hf_model, processor, prompt, images, MAX_TOKENS, **processor_kwargs)
        assert_matches_greedy(out, want, logits, prompt, prompt_ids=ids)


def test_images_match_transformers_batched_with_text(gemma3):
    folder, hf_model, processor = gemma3
    small, wide = random_image(0, 60, 90), random_image(1, 120, 200)
    prompts = [
        (f"describe{IMAGE} now", [small]),
        (f"two{IMAGE} and{IMAGE} compared", [wide, small]),
        ("plain text request without images", []),
    ]
    with LLM(str(folder), max_model_len=256, enable_prefix_caching=True) as llm:
        _check_against_transformers(llm, hf_model, processor, prompts)
        # Again: the prompts' blocks, images included, now come from the prefix cache.
        _check_against_transformers(llm, hf_model, processor, prompts[:2])


def test_two_ranks_match_transformers(gemma3):
    # The driver encodes and sends the workers the image embeddings and the spans they attend
    # both ways inside (worker/mm_broadcast.py).
    folder, hf_model, processor = gemma3
    prompts = [(f"two{IMAGE} and{IMAGE} compared", [random_image(1, 120, 200), random_image(0, 60, 90)]),
               ("plain text request without images", [])]
    with LLM(str(folder), max_model_len=256, tensor_parallel_size=2) as llm:
        _check_against_transformers(llm, hf_model, processor, prompts)


def test_a_small_step_budget_never_splits_an_image(gemma3):
    folder, hf_model, processor = gemma3
    # 20-token steps would cut the images' 16 soft tokens; the scheduler keeps each image whole.
    prompts = [(f"look{IMAGE} here and{IMAGE} there", [random_image(2, 150, 200), random_image(3, 80, 80)]),
               ("and a text request beside it", [])]
    with LLM(str(folder), max_model_len=256, max_num_batched_tokens=20, max_num_seqs=2,
             enable_prefix_caching=True) as llm:
        _check_against_transformers(llm, hf_model, processor, prompts)


def test_pan_and_scan_crops_match_transformers(gemma3):
    folder, hf_model, processor = gemma3
    # A 60x150 image with 32-pixel minimum crops: the original and 3 crops, 4 soft-token runs.
    options = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": 32}
    with LLM(str(folder), max_model_len=256, mm_processor_kwargs=options) as llm:
        _check_against_transformers(llm, hf_model, processor, [(f"wide{IMAGE} view", [random_image(5, 60, 150)])],
                                    **options)


def _hub_name(name: str) -> str:
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1)


def _transformers5_name(name: str) -> str:
    name = name.replace("language_model.model.", "language_model.", 1)
    return name if name.startswith("lm_head.") else f"model.{name}"


@pytest.mark.parametrize("rename", [_hub_name, _transformers5_name], ids=["hub", "transformers5"])
def test_checkpoint_name_layouts_load(gemma3, tmp_path, rename):
    folder, hf_model, processor = gemma3
    rewritten_checkpoint(folder, tmp_path, lambda tensors: {rename(k): v for k, v in tensors.items()})
    with LLM(str(tmp_path), max_model_len=256) as llm:
        _check_against_transformers(llm, hf_model, processor, [(f"see{IMAGE} it", [random_image(6, 40, 40)])])


def test_a_step_budget_smaller_than_an_image_is_refused(gemma3):
    folder, _, _ = gemma3
    with pytest.raises(ValueError, match=r"`max_num_batched_tokens` must be >= 16 .*Given: 12"):
        LLM(str(folder), max_model_len=256, max_num_batched_tokens=12)


@pytest.mark.parametrize("text_only", [{"limit_mm_per_prompt": {"image": 0}}, {"language_model_only": True}],
                         ids=["limit_0", "language_model_only"])
def test_text_only_skips_the_vision_tower(gemma3, caplog, text_only):
    folder, hf_model, processor = gemma3
    with caplog.at_level(logging.INFO, logger="ferrollm"):
        llm = LLM(str(folder), max_model_len=256, **text_only)
    with llm:
        model = llm.llm_engine.generation_runner.model
        assert model.vision_tower is None and model.multi_modal_projector is None
        assert not any(name.startswith(("vision", "multi_modal")) for name, _ in model.named_parameters())
        assert "skipped the" in caplog.text and "vision tower and projector tensors" in caplog.text
        _check_against_transformers(llm, hf_model, processor, [("a text only prompt", [])])
        with pytest.raises(ValueError, match=r"At most 0 image.*Given: 1"):
            llm.generate({"prompt": f"x{IMAGE}", "multi_modal_data": {"image": random_image(4, 30, 30)}},
                         GREEDY, use_tqdm=False)
        # Gemma 3 takes no video in ferrollm: the refusal names what it takes.
        with pytest.raises(ValueError, match=r"keys must be one of \['image'\].*Given: 'video'"):
            llm.generate({"prompt": "x", "multi_modal_data": {"video": [random_image(4, 30, 30)]}},
                         GREEDY, use_tqdm=False)
