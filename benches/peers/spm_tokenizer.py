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
import struct
import sys
from pathlib import Path

# Field numbers and enum values of sentencepiece_model.proto. The model is written by hand (it is
# one repeated message and two small specs) because sentencepiece's generated protobuf module
# wants a newer protobuf than the converter's requirements pin.
MODEL_PIECES, MODEL_TRAINER_SPEC, MODEL_NORMALIZER_SPEC = 1, 2, 3
PIECE_TEXT, PIECE_SCORE, PIECE_TYPE = 1, 2, 3
NORMAL, UNKNOWN, CONTROL = 1, 2, 3
TRAINER_MODEL_TYPE, TRAINER_VOCAB_SIZE, UNIGRAM = 3, 4, 1
NORMALIZER_NAME, NORMALIZER_ADD_DUMMY_PREFIX = 1, 3
SPECIAL_TYPES = {"<unk>": UNKNOWN, "<s>": CONTROL, "</s>": CONTROL}  # ids 0, 1, 2: spm's defaults


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _int_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def _bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def _float_field(number: int, value: float) -> bytes:
    return _varint(number << 3 | 5) + struct.pack("<f", value)


def vocabulary(checkpoint: Path) -> list[str]:
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.__getitem__)
    if [vocab[p] for p in pieces] != list(range(len(pieces))):
        raise ValueError("tokenizer.json ids are not contiguous from 0")
    return pieces


def serialize(pieces: list[str]) -> bytes:
    out = bytearray()
    for i, text in enumerate(pieces):
        piece = (_bytes_field(PIECE_TEXT, text.encode()) + _float_field(PIECE_SCORE, -float(i))
                 + _int_field(PIECE_TYPE, SPECIAL_TYPES.get(text, NORMAL)))
        out += _bytes_field(MODEL_PIECES, piece)
    trainer = _int_field(TRAINER_MODEL_TYPE, UNIGRAM) + _int_field(TRAINER_VOCAB_SIZE, len(pieces))
    normalizer = _bytes_field(NORMALIZER_NAME, b"identity") + _int_field(NORMALIZER_ADD_DUMMY_PREFIX, 0)
    out += _bytes_field(MODEL_TRAINER_SPEC, trainer) + _bytes_field(MODEL_NORMALIZER_SPEC, normalizer)
    return bytes(out)


def main(checkpoint: str, out: str) -> None:
    pieces = vocabulary(Path(checkpoint))
    (Path(out) / "tokenizer.model").write_bytes(serialize(pieces))
    print(f"tokenizer.model: {len(pieces)} pieces -> {out}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
