"""InternVL (-hf layout): a tiny random ``InternVLForConditionalGeneration`` through `LLM.generate`
matches transformers' greedy tokens and log-probabilities (one image, two images, batched with a
text request); the prompt is expanded as ``InternVLProcessor`` expands it, with its dynamic tiling
(``max_dynamic_patch`` changing the tile and token count); `limit_mm_per_prompt={"image": 0}`
skips the vision tower."""

from __future__ import annotations

import json

import pytest
import torch
from ferrollm import LLM, SamplingParams
from helpers.checkpoints import rewritten_checkpoint
from helpers.internvl_checkpoints import TOKENS_PER_TILE, build_internvl_checkpoint, hf_greedy_internvl
from helpers.vl_checkpoints import assert_matches_greedy, random_image

torch.set_num_threads(2)

MAX_TOKENS = 5
IMAGE = "<IMG_CONTEXT>"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def internvl(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("internvl")
    model, processor = build_internvl_checkpoint(folder, tokenizer_dir)
    return folder, model, processor


def _check_against_transformers(llm: LLM, hf_model, processor, prompts: list[tuple[str, list]],
                                request_kwargs: dict | None = None, **processor_kwargs):
    requests = [{"prompt": p, "multi_modal_data": {"image": imgs}, **({"mm_processor_kwargs": request_kwargs}
                                                                       if request_kwargs else {})}
                if imgs else p for p, imgs in prompts]
    outs = llm.generate(requests, GREEDY, use_tqdm=False)
    for (prompt, images), out in zip(prompts, outs):
        ids, want, logits = hf_greedy_internvl(hf_model, processor, prompt, images, MAX_TOKENS, **processor_kwargs)
        assert_matches_greedy(out, want, logits, prompt, prompt_ids=ids)
    return outs


def test_images_match_transformers_batched_with_text(internvl):
    folder, hf_model, processor = internvl
    small, wide = random_image(0, 40, 50), random_image(1, 60, 170)
    prompts = [
        (f"describe{IMAGE} now", [small]),
        (f"two{IMAGE} and{IMAGE} compared", [wide, small]),
        ("plain text request without images", []),
    ]
    with LLM(str(folder), max_model_len=256, enable_prefix_caching=True) as llm:
        _check_against_transformers(llm, hf_model, processor, prompts)


def test_max_dynamic_patch_sets_the_tiles_as_the_processor_does(internvl):
    folder, hf_model, processor = internvl
    wide = random_image(2, 60, 230)  # about 4:1: 4 tiles + a thumbnail under the checkpoint's max of 6
    with LLM(str(folder), max_model_len=256) as llm:
        default = _check_against_transformers(llm, hf_model, processor, [(f"w{IMAGE}", [wide])])
        # A request's max_dynamic_patch is transformers' max_patches: 2 tiles + the thumbnail.
        two = _check_against_transformers(llm, hf_model, processor, [(f"w{IMAGE}", [wide])],
                                          {"max_dynamic_patch": 2}, max_patches=2)
    count = [list(o.prompt_token_ids).count(hf_model.config.image_token_id) for o in default + two]
    assert count == [5 * TOKENS_PER_TILE, 3 * TOKENS_PER_TILE]
    with LLM(str(folder), max_model_len=256, mm_processor_kwargs={"max_dynamic_patch": 1}) as llm:
        one = _check_against_transformers(llm, hf_model, processor, [(f"w{IMAGE}", [wide])], max_patches=1)
    assert list(one[0].prompt_token_ids).count(hf_model.config.image_token_id) == TOKENS_PER_TILE


def test_limit_0_skips_the_vision_tower(internvl):
    folder, hf_model, processor = internvl
    with LLM(str(folder), max_model_len=256, limit_mm_per_prompt={"image": 0}) as llm:
        model = llm.llm_engine.generation_runner.model
        assert model.vision_tower is None and model.multi_modal_projector is None
        assert not any(name.startswith(("vision", "multi_modal")) for name, _ in model.named_parameters())
        _check_against_transformers(llm, hf_model, processor, [("a text only prompt", [])])
        with pytest.raises(ValueError, match=r"At most 0 image.*Given: 1"):
            llm.generate({"prompt": f"x{IMAGE}", "multi_modal_data": {"image": random_image(4, 30, 30)}},
                         GREEDY, use_tqdm=False)
        # InternVL takes no video in ferrollm: the refusal names what it takes.
        with pytest.raises(ValueError, match=r"keys must be one of \['image'\].*Given: 'video'"):
            llm.generate({"prompt": "x", "multi_modal_data": {"video": [random_image(4, 30, 30)]}},
                         GREEDY, use_tqdm=False)


def _transformers5_name(name: str) -> str:
    name = name.replace("language_model.model.", "language_model.", 1)
    return "lm_head.weight" if name == "language_model.lm_head.weight" else f"model.{name}"


def test_transformers5_names_and_an_expanded_prompt_load(internvl, tmp_path):
    folder, hf_model, processor = internvl
    rewritten_checkpoint(folder, tmp_path, lambda tensors: {_transformers5_name(k): v for k, v in tensors.items()})
    image = random_image(6, 50, 40)
    with LLM(str(tmp_path), max_model_len=256) as llm:
        (out,) = _check_against_transformers(llm, hf_model, processor, [(f"see{IMAGE} it", [image])])
        # The processor's own expansion, given as ids, is taken as it is.
        again = llm.generate({"prompt_token_ids": list(out.prompt_token_ids), "multi_modal_data": {"image": image}},
                             GREEDY, use_tqdm=False)[0]
        assert list(again.outputs[0].token_ids) == list(out.outputs[0].token_ids)
        with pytest.raises(ValueError, match=r"placeholder"):
            llm.generate({"prompt": f"one{IMAGE} only", "multi_modal_data": {"image": [image, image]}},
                         GREEDY, use_tqdm=False)


def test_a_checkpoint_without_lm_head_ties_it_as_transformers_does(internvl, tmp_path):
    folder, _, _ = internvl
    tensors = rewritten_checkpoint(folder, tmp_path, lambda tensors: {
        k: v for k, v in tensors.items() if k != "language_model.lm_head.weight"})
    stored_head = tensors["language_model.lm_head.weight"]
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("tie_word_embeddings", None)  # transformers' default: True at the top level
    (tmp_path / "config.json").write_text(json.dumps(config))
    with LLM(str(tmp_path), max_model_len=256, limit_mm_per_prompt={"image": 0}) as llm:
        lm = llm.llm_engine.generation_runner.model.language_model
        embedding = tensors["language_model.model.embed_tokens.weight"]
        head = lm.lm_head.dense_weight()  # the packed form holds the table once
        assert torch.equal(head, embedding) and not torch.equal(head, stored_head)
