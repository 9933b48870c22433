"""Writes the benchmark checkpoints: a Qwen2-0.5B-shaped model with random weights (hidden 896,
24 layers, 14 heads / 2 KV heads, intermediate 4864, vocab 151936, fp32 by default, bf16 with
``--dtype bfloat16`` as the GPU runs use) and a word-level tokenizer covering its whole
vocabulary, so random-token workloads detokenize cleanly.

    python benches/make_checkpoint.py .bench/qwen2-0.5b [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers

VOCAB = 151936


def write_tokenizer(folder: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"t{i}": i for i in range(3, VOCAB)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_model(folder: Path, dtype: torch.dtype = torch.float32) -> None:
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864, vocab_size=VOCAB, max_position_embeddings=32768,
        tie_word_embeddings=True, rope_theta=1000000.0, eos_token_id=2, bos_token_id=1,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to(dtype).save_pretrained(folder)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", default=".bench/qwen2-0.5b")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the dtype the weights are stored in (drawn in fp32 from the same seed either way)")
    args = p.parse_args()
    path = Path(args.folder)
    path.mkdir(parents=True, exist_ok=True)
    if not (path / "model.safetensors").exists() and not (path / "model.safetensors.index.json").exists():
        write_model(path, getattr(torch, args.dtype))
    write_tokenizer(path)
    print(path)


if __name__ == "__main__":
    main()
