"""A tiny random InternVL (``InternVLForConditionalGeneration``, Qwen2 text) with a locally built
``InternVLProcessor`` (``GotOcr2ImageProcessor`` on 56-pixel tiles, the test tokenizer carrying
InternVL's image tokens under the names the processor reads), and transformers' greedy reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer

START, END, CONTEXT, VIDEO = "<img>", "</img>", "<IMG_CONTEXT>", "<video>"
# The test tokenizer has 380 entries; the image tokens take 380..383 of the model's 384.
VOCAB = 384
TILE = 56
# 56-pixel tiles in 14-pixel patches: a 4x4 grid, pixel-shuffled 2x2 to 4 tokens a tile.
TOKENS_PER_TILE = 4


def internvl_config(context_id: int, text_type: str = "qwen2"):
    text = dict(model_type=text_type, vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                eos_token_id=2, bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=TILE, patch_size=14, use_qk_norm=True, attention_bias=True)
    config = transformers.InternVLConfig(text_config=text, vision_config=vision, image_token_id=context_id,
                                         image_seq_length=TOKENS_PER_TILE, tie_word_embeddings=False)
    config.architectures = ["InternVLForConditionalGeneration"]
    return config


def build_internvl_checkpoint(folder: Path, tokenizer_dir: Path, seed: int = 0, text_type: str = "qwen2"):
    """Saves a random tiny InternVL (``text_type`` "qwen2" or "llama"), its tokenizer and its
    processor to ``folder``; returns the transformers model in eval mode and the processor."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (START, END, CONTEXT, VIDEO)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast",
        "extra_special_tokens": {"start_image_token": START, "end_image_token": END,
                                 "context_image_token": CONTEXT, "video_token": VIDEO}}))
    torch.manual_seed(seed)
    model = transformers.InternVLForConditionalGeneration(internvl_config(tok.token_to_id(CONTEXT), text_type)).eval()
    with torch.no_grad():  # transformers starts these at zero / a constant: random, so the test sees them
        for name, param in model.named_parameters():
            if name.endswith(("cls_token", "position_embeddings", "lambda_1", "lambda_2")):
                param.normal_(0, 0.5)
    model.save_pretrained(folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    image_processor = GotOcr2ImageProcessorPil(size={"height": TILE, "width": TILE}, max_patches=6)
    processor = _processor_without_video(image_processor, hf_tok)
    image_processor.save_pretrained(folder)  # the engine reads preprocessor_config.json
    return model, processor


def _processor_without_video(image_processor, tokenizer):
    """``InternVLProcessor`` with no video processor: its class check looks the video class up,
    which fails without torchvision (not a test dependency), so it is skipped for that argument."""
    cls = transformers.InternVLProcessor
    check = cls.check_argument_for_proper_class

    def skip_video(self, name, arg):
        return None if name == "video_processor" and arg is None else check(self, name, arg)

    cls.check_argument_for_proper_class = skip_video
    try:
        return cls(image_processor, tokenizer, None, image_seq_length=TOKENS_PER_TILE)
    finally:
        cls.check_argument_for_proper_class = check


def hf_greedy_internvl(model, processor, prompt: str, images: list, max_tokens: int, **processor_kwargs):
    """transformers' input ids, greedy tokens and per-step logits for ``prompt`` (one
    ``<IMG_CONTEXT>`` per image), processed by ``InternVLProcessor``."""
    inputs = processor(text=prompt, images=images or None, return_tensors="pt", **processor_kwargs)
    kwargs = {"pixel_values": inputs["pixel_values"]} if "pixel_values" in inputs else {}
    with torch.no_grad():
        out = model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    ids = inputs["input_ids"][0].tolist()
    return ids, out.sequences[0, len(ids):].tolist(), torch.stack(out.logits, dim=1)[0]
