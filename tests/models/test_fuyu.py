"""Fuyu: a tiny random ``FuyuForCausalLM`` through `LLM.generate` matches transformers' greedy
tokens and log-probabilities for image prompts laid out as ``FuyuProcessor`` lays them out
(patch rows of ``|SPEAKER|`` closed by ``|NEWLINE|``, then ``<s>``, the text and ``<0x04>``),
batched with a text request, with chunked prefill splitting the images and prefix-cache hits;
``mm_processor_kwargs``' ``size`` changes the patch grid as the image processor does; an already
expanded prompt and transformers 5's weight names load; one image per prompt;
`limit_mm_per_prompt={"image": 0}` skips ``vision_embed_tokens``; two ranks run images too."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers
from ferrollm import LLM, SamplingParams
from helpers.checkpoints import rewritten_checkpoint
from helpers.fuyu_checkpoints import build_fuyu_checkpoint, hf_greedy_fuyu
from helpers.vl_checkpoints import assert_matches_greedy, random_image

torch.set_num_threads(2)

MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def fuyu(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("fuyu")
    model, image_processor = build_fuyu_checkpoint(folder, tokenizer_dir)
    return folder, model, transformers.AutoTokenizer.from_pretrained(str(folder)), image_processor


def _check_against_transformers(llm: LLM, fuyu, prompts: list[tuple[str, object]], request_kwargs=None,
                                **image_kwargs):
    _, hf_model, tokenizer, image_processor = fuyu
    extra = {"mm_processor_kwargs": request_kwargs} if request_kwargs else {}
    requests = [{"prompt": p, "multi_modal_data": {"image": image}, **extra} if image is not None else p
                for p, image in prompts]
    outs = llm.generate(requests, GREEDY, use_tqdm=False)
    for (prompt, image), out in zip(prompts, outs):
        ids, want, logits = hf_greedy_fuyu(hf_model, tokenizer, image_processor, prompt, image, MAX_TOKENS,
                                           **image_kwargs)
        assert_matches_greedy(out, want, logits, prompt, prompt_ids=ids)
    return outs


def test_images_match_transformers_batched_with_text_and_chunked(fuyu):
    folder = fuyu[0]
    # 35x50 stays (4 rows of 5 patches); 90x200 shrinks to 27x60 (3 rows of 6); 100x30 to 40x12 (4 of 2).
    prompts = [("describe this", random_image(0, 35, 50)), ("plain text request without images", None),
               ("what is in the wide one", random_image(1, 90, 200)), ("tall", random_image(2, 100, 30))]
    # A 16-token step budget splits every image run (20-28 tokens) across prefill chunks.
    with LLM(str(folder), max_model_len=256, max_num_batched_tokens=16, max_num_seqs=2,
             enable_prefix_caching=True) as llm:
        outs = _check_against_transformers(llm, fuyu, prompts)
        # Again: the image prompts' blocks now come from the prefix cache.
        _check_against_transformers(llm, fuyu, prompts[:1] + prompts[2:])
    runs = [list(o.prompt_token_ids) for o in outs]
    speaker, newline = fuyu[1].config.image_token_id, fuyu[2].convert_tokens_to_ids("|NEWLINE|")
    assert [(r.count(speaker), r.count(newline)) for r in runs] == [(20, 4), (0, 0), (18, 3), (8, 4)]


def test_size_from_mm_processor_kwargs_sets_the_patch_grid(fuyu):
    folder = fuyu[0]
    image, small = random_image(6, 35, 50), {"size": {"height": 20, "width": 30}}
    with LLM(str(folder), max_model_len=256, mm_processor_kwargs=small) as llm:
        # Shrunk to 20x28: 2 rows of 3 patches, for the LLM's option and a request's own.
        (out,) = _check_against_transformers(llm, fuyu, [("small", image)], **small)
        (again,) = _check_against_transformers(llm, fuyu, [("small", image)], small, **small)
    speaker = fuyu[1].config.image_token_id
    assert list(out.prompt_token_ids).count(speaker) == list(again.prompt_token_ids).count(speaker) == 6


def test_two_ranks_match_transformers_and_run_the_text_only_model_as_one_does(fuyu):
    folder, prompts = fuyu[0], ["hello there", "a longer text only request"]
    with LLM(str(folder), max_model_len=256, tensor_parallel_size=2) as llm:
        # The driver embeds the patches and sends the rows to the other rank (worker/mm_broadcast.py).
        _check_against_transformers(llm, fuyu, [("caption", random_image(4, 40, 70)), (prompts[0], None)])
    outs = []
    for tp in (1, 2):
        with LLM(str(folder), max_model_len=128, tensor_parallel_size=tp, limit_mm_per_prompt={"image": 0}) as llm:
            outs.append([list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)])
    assert outs[0] == outs[1]


def _transformers5_name(name: str) -> str:
    if name == "language_model.lm_head.weight":
        return "lm_head.weight"
    return "model." + name.replace("language_model.model.", "language_model.", 1)


def test_transformers5_names_and_an_expanded_prompt_load(fuyu, tmp_path):
    folder = fuyu[0]
    rewritten_checkpoint(folder, tmp_path, lambda tensors: {_transformers5_name(k): v for k, v in tensors.items()})
    image = random_image(3, 30, 40)
    with LLM(str(tmp_path), max_model_len=256) as llm:
        (out,) = _check_against_transformers(llm, fuyu, [("see it", image)])
        # The processor's own layout, given as ids, is taken as it is.
        again = llm.generate({"prompt_token_ids": list(out.prompt_token_ids), "multi_modal_data": {"image": image}},
                             GREEDY, use_tqdm=False)[0]
        assert list(again.prompt_token_ids) == list(out.prompt_token_ids)
        assert list(again.outputs[0].token_ids) == list(out.outputs[0].token_ids)
        # A run for another grid (one patch row missing) is refused.
        short = list(out.prompt_token_ids)[4:]
        with pytest.raises(ValueError, match=r"exactly one run of 3 rows of 4 placeholders"):
            llm.generate({"prompt_token_ids": short, "multi_modal_data": {"image": image}}, GREEDY, use_tqdm=False)


def test_one_image_per_prompt(fuyu):
    folder = fuyu[0]
    with pytest.raises(ValueError, match=r"`limit_mm_per_prompt\['image'\]` must be <= 1 .*Given: 2"):
        LLM(str(folder), max_model_len=256, limit_mm_per_prompt={"image": 2})
    with pytest.raises(ValueError, match=r"`mm_processor_kwargs\['patch_size'\]` cannot be set"):
        LLM(str(folder), max_model_len=256, mm_processor_kwargs={"patch_size": {"height": 5, "width": 5}})
    with LLM(str(folder), max_model_len=256) as llm:
        image = random_image(4, 30, 30)
        with pytest.raises(ValueError, match=r"At most 1 image.*Given: 2"):
            llm.generate({"prompt": "two", "multi_modal_data": {"image": [image, image]}}, GREEDY, use_tqdm=False)


def test_limit_0_skips_vision_embed_tokens(fuyu, caplog):
    folder = fuyu[0]
    with caplog.at_level(logging.INFO), LLM(str(folder), max_model_len=256, limit_mm_per_prompt={"image": 0}) as llm:
        model = llm.llm_engine.generation_runner.model
        assert model.vision_embed_tokens is None
        assert not any(name.startswith("vision") for name, _ in model.named_parameters())
        _check_against_transformers(llm, fuyu, [("a text only prompt", None)])
        with pytest.raises(ValueError, match=r"At most 0 image.*Given: 1"):
            llm.generate({"prompt": "x", "multi_modal_data": {"image": random_image(5, 30, 30)}},
                         GREEDY, use_tqdm=False)
    assert "skipped the 2 vision_embed_tokens tensors" in caplog.text
