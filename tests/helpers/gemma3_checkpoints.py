"""A tiny random Gemma 3 (``Gemma3ForConditionalGeneration``) with a locally built
``Gemma3Processor`` (the image processor's defaults and the test tokenizer carrying Gemma 3's
image tokens under the names the processor reads), and transformers' greedy reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer

BOI, EOI, SOFT = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
# The test tokenizer has 380 entries; the image tokens take 380..382 of the model's 384.
VOCAB = 384
TOKENS_PER_IMAGE = 16


def gemma3_config(ids: dict[str, int]):
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16,
                max_position_embeddings=512, sliding_window=12, layer_types=["sliding_attention", "full_attention"],
                eos_token_id=2, bos_token_id=1, pad_token_id=0)
    # 224-pixel images (the processor's default size) in 14-pixel patches, pooled 4x4 to 16 tokens.
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                  image_size=224, patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=TOKENS_PER_IMAGE,
                                       boi_token_index=ids[BOI], eoi_token_index=ids[EOI],
                                       image_token_index=ids[SOFT])
    config.architectures = ["Gemma3ForConditionalGeneration"]
    return config


def build_gemma3_checkpoint(folder: Path, tokenizer_dir: Path, seed: int = 0):
    """Saves a random tiny Gemma 3, its tokenizer and its processor to ``folder``; returns the
    transformers model in eval mode and the processor."""
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (BOI, EOI, SOFT)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast",
        "extra_special_tokens": {"boi_token": BOI, "eoi_token": EOI, "image_token": SOFT}}))
    ids = {t: tok.token_to_id(t) for t in (BOI, EOI, SOFT)}
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(gemma3_config(ids)).eval()
    model.save_pretrained(folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    processor = transformers.Gemma3Processor(Gemma3ImageProcessorPil(), hf_tok, image_seq_length=TOKENS_PER_IMAGE)
    processor.save_pretrained(folder)
    return model, processor


def hf_greedy_gemma3(model, processor, prompt: str, images: list, max_tokens: int, **processor_kwargs):
    """transformers' input ids, greedy tokens and per-step logits for ``prompt`` (one
    ``<start_of_image>`` per image), processed by ``Gemma3Processor``."""
    inputs = processor(text=prompt, images=images or None, return_tensors="pt", **processor_kwargs)
    kwargs = {k: inputs[k] for k in ("pixel_values", "token_type_ids") if k in inputs}
    with torch.no_grad():
        out = model.generate(inputs["input_ids"], attention_mask=inputs["attention_mask"], max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kwargs)
    ids = inputs["input_ids"][0].tolist()
    return ids, out.sequences[0, len(ids):].tolist(), torch.stack(out.logits, dim=1)[0]
