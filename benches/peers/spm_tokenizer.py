"""Writes a SentencePiece ``tokenizer.model`` with the checkpoint's own vocabulary, for GGUF conversion.

llama.cpp's HF->GGUF converter takes a Qwen2 tokenizer either as SentencePiece (``tokenizer.model``)
or as byte-level BPE whose pre-tokenizer it recognises by hashing how a fixed text encodes; our
benchmark checkpoint's word-level ``tokenizer.json`` is neither. This writes the same 151936
pieces, in the same order and so with the same ids (``<unk>``, ``<s>``, ``</s>``, ``t3`` ...), as a
SentencePiece model, so the converter keeps every id and the vocabulary size. The benchmarks feed
token ids, so how llama.cpp would split text with it never matters.

    python spm_tokenizer.py CHECKPOINT_DIR OUT_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sentencepiece import sentencepiece_model_pb2 as spm_pb2

SPECIAL_TYPES = {"<unk>": spm_pb2.ModelProto.SentencePiece.UNKNOWN,
                 "<s>": spm_pb2.ModelProto.SentencePiece.CONTROL,
                 "</s>": spm_pb2.ModelProto.SentencePiece.CONTROL}


def vocabulary(checkpoint: Path) -> list[str]:
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.__getitem__)
    if [vocab[p] for p in pieces] != list(range(len(pieces))):
        raise ValueError("tokenizer.json ids are not contiguous from 0")
    return pieces


def write_model(pieces: list[str], out: Path) -> None:
    model = spm_pb2.ModelProto()
    model.trainer_spec.model_type = spm_pb2.TrainerSpec.UNIGRAM
    model.trainer_spec.vocab_size = len(pieces)
    model.trainer_spec.unk_id, model.trainer_spec.bos_id = 0, 1
    model.trainer_spec.eos_id, model.trainer_spec.pad_id = 2, -1
    model.normalizer_spec.name = "identity"
    model.normalizer_spec.add_dummy_prefix = False
    for i, text in enumerate(pieces):
        piece = model.pieces.add()
        piece.piece = text
        piece.score = -float(i)
        piece.type = SPECIAL_TYPES.get(text, spm_pb2.ModelProto.SentencePiece.NORMAL)
    (out / "tokenizer.model").write_bytes(model.SerializeToString())


def main(checkpoint: str, out: str) -> None:
    pieces = vocabulary(Path(checkpoint))
    write_model(pieces, Path(out))
    print(f"tokenizer.model: {len(pieces)} pieces -> {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
