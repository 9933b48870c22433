"""InternVLChatModel (OpenGVLab's InternVL2 layout, remote code on the hub): the tiny random -hf
InternVL of `internvl_checkpoints`, written under the published names with an ``internvl_chat``
config.json (its Llama text re-laid as InternLM2, or a Qwen2 as it is), must generate through
`LLM` what transformers' ``InternVLForConditionalGeneration`` generates from the original, for
prompts that carry InternVL2's ``<image>`` (one image, two, batched with text). The engine tiles
as the model card's ``dynamic_preprocess`` does, ``max_dynamic_patch`` meaning transformers'
``max_patches``; `limit_mm_per_prompt={"image": 0}` skips the vision tower."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from helpers.internvl_chat_checkpoints import MAX_DYNAMIC_PATCH, build_internvl_chat_checkpoint, dynamic_preprocess
from helpers.internvl_checkpoints import CONTEXT, TILE, TOKENS_PER_TILE, hf_greedy_internvl
from helpers.vl_checkpoints import assert_matches_greedy, random_image

from ferrollm import LLM, SamplingParams
from ferrollm.config.remote_configs import load_hf_config
from ferrollm.exceptions import ConfigError
from ferrollm.multimodal.cache import MultiModalInputCache
from ferrollm.multimodal.internvl_processor import InternVLChatMultiModalProcessor

torch.set_num_threads(2)

MAX_TOKENS = 5
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def chat(tmp_path_factory, tokenizer_dir):
    folder = tmp_path_factory.mktemp("internvl-chat") / "model"
    model, processor = build_internvl_chat_checkpoint(folder, tokenizer_dir)
    return folder, model, processor


def _check_against_transformers(llm: LLM, hf_model, processor, prompts: list[tuple[str, list]],
                                request_kwargs: dict | None = None, **processor_kwargs):
    extra = {"mm_processor_kwargs": request_kwargs} if request_kwargs else {}
    requests = [{"prompt": p, "multi_modal_data": {"image": imgs}, **extra} if imgs else p for p, imgs in prompts]
    outs = llm.generate(requests, GREEDY, use_tqdm=False)
    for (prompt, images), out in zip(prompts, outs):
        # transformers' InternVLProcessor takes <IMG_CONTEXT> where InternVL2's chat takes <image>.
        ids, want, logits = hf_greedy_internvl(hf_model, processor, prompt.replace("<image>", CONTEXT), images,
                                               MAX_TOKENS, **processor_kwargs)
        assert_matches_greedy(out, want, logits, prompt, prompt_ids=ids)
    return outs


def test_images_match_transformers_batched_with_text(chat):
    folder, hf_model, processor = chat
    small, wide = random_image(0, 40, 50), random_image(1, 60, 170)
    prompts = [
        ("<image>\ndescribe it", [small]),
        ("two <image> and <image> compared", [wide, small]),
        ("plain text request without images", []),
    ]
    with LLM(str(folder), max_model_len=256) as llm:
        model = llm.llm_engine.generation_runner.model
        assert type(model.language_model).__name__ == "InternLM2ForCausalLM"
        _check_against_transformers(llm, hf_model, processor, prompts)


def test_max_dynamic_patch_sets_the_tiles_as_max_patches_does(chat):
    folder, hf_model, processor = chat
    wide = random_image(2, 60, 230)  # about 4:1: 4 tiles + a thumbnail under the config's max of 6
    context = hf_model.config.image_token_id
    with LLM(str(folder), max_model_len=256) as llm:
        default = _check_against_transformers(llm, hf_model, processor, [("w<image>", [wide])])
        two = _check_against_transformers(llm, hf_model, processor, [("w<image>", [wide])],
                                          {"max_dynamic_patch": 2}, max_patches=2)
    counts = [list(o.prompt_token_ids).count(context) for o in default + two]
    assert counts == [5 * TOKENS_PER_TILE, 3 * TOKENS_PER_TILE]
    with LLM(str(folder), max_model_len=256, mm_processor_kwargs={"max_dynamic_patch": 1}) as llm:
        one = _check_against_transformers(llm, hf_model, processor, [("w<image>", [wide])], max_patches=1)
    assert list(one[0].prompt_token_ids).count(context) == TOKENS_PER_TILE


@pytest.mark.parametrize("use_thumbnail", [True, False])
def test_tiles_are_dynamic_preprocess_tiles(chat, use_thumbnail, tmp_path):
    folder, _, _ = chat
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_thumbnail": use_thumbnail}))
    hf_config = load_hf_config(tmp_path)
    proc = InternVLChatMultiModalProcessor(tmp_path, hf_config, {"image": 9}, None, MultiModalInputCache(1 << 24))
    for seed, (h, w) in enumerate([(40, 50), (60, 230), (300, 100), (56, 56), (90, 200)]):
        image = random_image(10 + seed, h, w)
        _, tiles = proc._tiles(image, {})
        want = dynamic_preprocess(image, 1, MAX_DYNAMIC_PATCH, TILE, use_thumbnail)
        assert tiles.shape == want.shape, (h, w)
        torch.testing.assert_close(tiles, want, atol=1e-5, rtol=0)
    assert proc.max_tokens_per_item() == (MAX_DYNAMIC_PATCH + use_thumbnail) * TOKENS_PER_TILE


def test_limit_0_skips_the_vision_tower(chat, caplog, capsys):
    folder, hf_model, processor = chat
    with caplog.at_level(logging.INFO, logger="ferrollm"):
        llm = LLM(str(folder), max_model_len=256, limit_mm_per_prompt={"image": 0})
    with llm:
        model = llm.llm_engine.generation_runner.model
        assert model.vision_tower is None and model.multi_modal_projector is None
        assert not any(name.startswith(("vision", "multi_modal")) for name, _ in model.named_parameters())
        # Counted as the checkpoint stores them (qkv fused): 2 layers of 16, 4 embedding tensors, 6 of mlp1.
        assert "skipped the 42 vision tower and projector tensors" in caplog.text
        _check_against_transformers(llm, hf_model, processor, [("a text only prompt", [])])
        # transformers' tokenizer loads without asking to run the config's remote code.
        assert llm.get_tokenizer().convert_tokens_to_ids(CONTEXT) == hf_model.config.image_token_id
        assert "custom code" not in capsys.readouterr().out
        with pytest.raises(ValueError, match=r"At most 0 image.*Given: 1"):
            llm.generate({"prompt": "x<image>", "multi_modal_data": {"image": random_image(4, 30, 30)}},
                         GREEDY, use_tqdm=False)


def test_a_qwen2_text_model_loads_under_the_chat_names(tmp_path, tokenizer_dir):
    folder = tmp_path / "model"
    hf_model, processor = build_internvl_chat_checkpoint(folder, tokenizer_dir, internlm2=False)
    with LLM(str(folder), max_model_len=256) as llm:
        assert type(llm.llm_engine.generation_runner.model.language_model).__name__ == "Qwen2ForCausalLM"
        _check_against_transformers(llm, hf_model, processor, [("see <image> it", [random_image(6, 50, 40)])])


def test_unsupported_layouts_are_config_errors(chat, tmp_path):
    folder, _, _ = chat
    for f in folder.iterdir():
        shutil.copy(f, tmp_path / f.name)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "ps_version": "v1"}))
    with pytest.raises(ConfigError, match=r"ps_version.*Given: 'v1'"):
        load_hf_config(tmp_path)
    llm_config = {**config["llm_config"], "architectures": ["Phi3ForCausalLM"]}
    (tmp_path / "config.json").write_text(json.dumps({**config, "llm_config": llm_config}))
    with pytest.raises(ConfigError, match=r"llm_config.architectures.*Phi3ForCausalLM"):
        load_hf_config(tmp_path)


# InternLM2's template prints each message's content as a string: it knows nothing of images.
STRING_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_chat_writes_the_image_placeholder_before_the_text_for_a_string_template(chat):
    # As vLLM's "string" content format: "<image>" per image part, then the text, one per line.
    folder, hf_model, processor = chat
    image = random_image(2, 50, 60)
    message = [{"role": "user", "content": [{"type": "text", "text": "what is it"},
                                            {"type": "image_pil", "image_pil": image}]}]
    expected = "<|im_start|>user\n<image>\nwhat is it<|im_end|>\n<|im_start|>assistant\n"
    with LLM(str(folder), max_model_len=256) as llm:
        (out,) = llm.chat(message, GREEDY, use_tqdm=False, chat_template=STRING_TEMPLATE)
        assert out.prompt == expected
        (want,) = _check_against_transformers(llm, hf_model, processor, [(expected, [image])])
        assert list(out.outputs[0].token_ids) == list(want.outputs[0].token_ids)
        with pytest.raises(ValueError, match=r"`chat_template_content_format` must be one of .*Given: 'text'"):
            llm.chat(message, GREEDY, chat_template=STRING_TEMPLATE, chat_template_content_format="text")
