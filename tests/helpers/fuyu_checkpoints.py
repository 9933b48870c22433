"""A tiny random Fuyu (``FuyuForCausalLM``, tiny Persimmon text config, 10-pixel patches) with
the test tokenizer carrying Fuyu's ``|SPEAKER|``, ``|NEWLINE|`` and ``<0x04>`` tokens, a
``FuyuImageProcessor`` fitting images into 40x60 pixels, and transformers' greedy reference.

The reference's inputs are built from the image processor's patches in ``FuyuProcessor``'s
layout rather than by ``FuyuProcessor`` itself: it drops the first token of the tokenized
placeholder text (a SentencePiece prefix in Fuyu's own tokenizer), which with this byte-level
tokenizer is a real ``|SPEAKER|``, so its placeholders would not match its patches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import transformers
from tokenizers import AddedToken, Tokenizer

SPEAKER, NEWLINE, BEGIN_ANSWER = "|SPEAKER|", "|NEWLINE|", "<0x04>"
# The test tokenizer has 380 entries; Fuyu's tokens take 380..382 of the model's 384.
VOCAB = 384
PATCH = 10
SIZE = {"height": 40, "width": 60}


def fuyu_config(image_token_id: int):
    text = dict(model_type="persimmon", vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=512, initializer_range=0.2, qk_layernorm=True,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    # hidden_size at the top level too: transformers 5.17 (the H200's) sizes vision_embed_tokens
    # from it (default 4096), 5.24 from text_config; hub configs carry it in both places.
    config = transformers.FuyuConfig(text_config=text, hidden_size=text["hidden_size"], patch_size=PATCH, num_channels=3,
                                     image_token_id=image_token_id, initializer_range=0.2)
    config.architectures = ["FuyuForCausalLM"]
    return config


def build_fuyu_checkpoint(folder: Path, tokenizer_dir: Path, seed: int = 0):
    """Saves a random tiny Fuyu, its tokenizer and image processor to ``folder``; returns the
    transformers model in eval mode (never stopping at EOS) and the image processor."""
    from transformers.models.fuyu.image_processing_fuyu import FuyuImageProcessor

    tok = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (SPEAKER, NEWLINE, BEGIN_ANSWER)])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    torch.manual_seed(seed)
    model = transformers.FuyuForCausalLM(fuyu_config(tok.token_to_id(SPEAKER))).eval()
    with torch.no_grad():  # LayerNorms start as the identity: noise, so a swapped one shows
        for name, param in model.named_parameters():
            if "norm" in name:
                param.add_(torch.randn_like(param) * 0.2)
    model.save_pretrained(folder)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    image_processor = FuyuImageProcessor(size=SIZE, patch_size={"height": PATCH, "width": PATCH})
    image_processor.save_pretrained(folder)
    return model, image_processor


def fuyu_inputs(tokenizer, image_processor, prompt: str, image, **image_kwargs) -> tuple[list[int], torch.Tensor]:
    """``FuyuProcessor``'s input ids and patches for one image: the placeholder rows, ``<s>``,
    the prompt's tokens and ``<0x04>``."""
    out = image_processor(images=[image], return_tensors="pt", **image_kwargs)
    padded = out["images"][0]
    height = min(padded.shape[-2], math.ceil(out["image_unpadded_heights"][0][0].item() / PATCH) * PATCH)
    width = min(padded.shape[-1], math.ceil(out["image_unpadded_widths"][0][0].item() / PATCH) * PATCH)
    patches = image_processor.patchify_image(padded[..., :height, :width])[0]
    vocab = tokenizer.get_vocab()
    rows = ([vocab[SPEAKER]] * (width // PATCH) + [vocab[NEWLINE]]) * (height // PATCH)
    text = tokenizer.encode(prompt + BEGIN_ANSWER, add_special_tokens=False)
    return rows + [vocab["<s>"]] + text, patches


def hf_greedy_fuyu(model, tokenizer, image_processor, prompt: str, image, max_tokens: int, **image_kwargs):
    """transformers' input ids, greedy tokens and per-step logits for ``prompt`` with ``image``
    (None: the prompt alone, tokenized with its special tokens), the image processed with
    ``image_kwargs``."""
    if image is None:
        ids, kwargs = tokenizer.encode(prompt), {}
    else:
        ids, patches = fuyu_inputs(tokenizer, image_processor, prompt, image, **image_kwargs)
        kwargs = {"pixel_values": patches}
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                             output_logits=True, return_dict_in_generate=True, **kwargs)
    return ids, out.sequences[0, len(ids):].tolist(), torch.stack(out.logits, dim=1)[0]
