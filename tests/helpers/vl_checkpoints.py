"""Tiny random Qwen2-VL / Qwen2.5-VL checkpoints with a local image processor and a test
tokenizer carrying the vision special tokens, and transformers' greedy reference."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import AddedToken, Tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# The test tokenizer has 380 entries; the vision tokens take 380..383 of the models' 384.
VOCAB = 384
# Small images: at most 64 merged... patches keep the encoder cheap.
PROCESSOR = dict(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 32)


def _text_config() -> dict:
    return dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]}, eos_token_id=2, bos_token_id=1)


def vl_config(kind: str, token_ids: dict[str, int]):
    ids = dict(image_token_id=token_ids["<|image_pad|>"], video_token_id=token_ids["<|video_pad|>"],
               vision_start_token_id=token_ids["<|vision_start|>"], vision_end_token_id=token_ids["<|vision_end|>"])
    if kind == "qwen2_5_vl":
        vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      fullatt_block_indexes=[1], window_size=56)
        config = transformers.Qwen2_5_VLConfig(text_config=_text_config(), vision_config=vision, **ids)
        config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    else:
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)
        config = transformers.Qwen2VLConfig(text_config=_text_config(), vision_config=vision, **ids)
        config.architectures = ["Qwen2VLForConditionalGeneration"]
    return config


def build_vl_checkpoint(kind: str, folder: Path, tokenizer_dir: Path, seed: int = 0):
    """Saves a random tiny ``kind`` ("qwen2_vl" or "qwen2_5_vl") model, its tokenizer and its
    image processor to ``folder``; returns the transformers model in eval mode."""
    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    token_ids = {t: tok.token_to_id(t) for t in VISION_TOKENS}
    torch.manual_seed(seed)
    cls = (transformers.Qwen2_5_VLForConditionalGeneration if kind == "qwen2_5_vl"
           else transformers.Qwen2VLForConditionalGeneration)
    model = cls(vl_config(kind, token_ids)).eval()
    model.save_pretrained(folder)
    image_processor().save_pretrained(folder)
    return model


def image_processor(**kwargs):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    size = {"shortest_edge": kwargs.pop("min_pixels", PROCESSOR["min_pixels"]),
            "longest_edge": kwargs.pop("max_pixels", PROCESSOR["max_pixels"])}
    return Qwen2VLImageProcessorPil(size=size, **kwargs)


def random_image(seed: int, height: int, width: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8))


def hf_greedy_vl(model, token_ids: list[int], images: list, max_tokens: int, **processor_kwargs):
    """transformers' greedy tokens and per-step logits for a prompt whose one placeholder per
    image is expanded here as transformers' processor does."""
    config = model.config
    merge = config.vision_config.spatial_merge_size
    ids, pixel_values, grids = list(token_ids), None, None
    if images:
        out = image_processor(**processor_kwargs)(images=images, return_tensors="pt")
        pixel_values, grids = out["pixel_values"], out["image_grid_thw"]
        expanded: list[int] = []
        counts = iter((grids.prod(-1) // merge**2).tolist())
        for t in ids:
            expanded.extend([t] * next(counts) if t == config.image_token_id else [t])
        ids = expanded
    input_ids = torch.tensor([ids])
    kwargs = {}
    if images:
        kwargs = dict(pixel_values=pixel_values, image_grid_thw=grids,
                      mm_token_type_ids=(input_ids == config.image_token_id).int())
    with torch.no_grad():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    return out.sequences[0, len(ids):].tolist(), torch.stack(out.logits, dim=1)[0]


def assert_matches_greedy(out, want: list[int], logits: torch.Tensor, label: str,
                          prompt_ids: list[int] | None = None) -> None:
    """`out` (a `RequestOutput` with ``logprobs=0``) against transformers' greedy tokens ``want``
    and its logits per step: the same tokens (and prompt ids, if given), each token's
    log-probability within 1e-4."""
    if prompt_ids is not None:
        assert list(out.prompt_token_ids) == prompt_ids, label
    got = out.outputs[0]
    assert list(got.token_ids) == want, label
    ref = torch.log_softmax(logits.float(), -1)
    for step, (token, lp) in enumerate(zip(want, got.logprobs)):
        assert abs(lp[token].logprob - ref[step, token].item()) < 1e-4, (label, step)
