"""Tiny GGUF files written at test time with gguf-py's writer: a Llama- or Qwen2-style header, a
byte-level BPE tokenizer, and whatever tensors a test asks for."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, TokenType

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ c", "a t", "Ġc at"]


def byte_level_tokens() -> list[str]:
    """The special tokens, GPT-2's 256 byte characters, then one token per merge."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIAL_TOKENS + list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in MERGES]


def write_gguf(path: Path, arch: str = "llama", tensors: dict[str, tuple[np.ndarray, GGMLQuantizationType]] | None = None,
               name: str = "tiny", alignment: int | None = None, hidden: int = 64, ffn: int = 128) -> Path:
    """Writes a GGUF file: hidden size ``hidden`` (``ffn`` in the MLP), 2 layers, 4 heads (2 KV
    heads) and the byte-level tokenizer; ``tensors`` maps llama.cpp names to ``(array, type)``,
    where a quantized type's array holds its blocks as ``uint8`` rows."""
    tokens = byte_level_tokens()
    writer = GGUFWriter(path, arch)
    writer.add_name(name)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(2)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(hidden // 4)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([TokenType.CONTROL] * len(SPECIAL_TOKENS) + [TokenType.NORMAL] * (len(tokens) - len(SPECIAL_TOKENS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    for tensor_name, (array, qtype) in (tensors or {"token_embd.weight": (np.zeros((len(tokens), 64), np.float32),
                                                                          GGMLQuantizationType.F32)}).items():
        writer.add_tensor(tensor_name, array, raw_dtype=None if qtype == GGMLQuantizationType.F32 else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# Where random K-quant super-blocks keep their fp16 scales: (d, dmin or None, dmin / d). The mins'
# share makes a group's mean weight about zero (codes average 7.5 for Q4_K, 15.5 for Q5_K).
K_SCALE_FIELDS = {GGMLQuantizationType.Q4_K: (0, 2, 7.5), GGMLQuantizationType.Q5_K: (0, 2, 15.5),
                  GGMLQuantizationType.Q6_K: (208, None, 0.0)}


def quantized_blocks(qtype: GGMLQuantizationType, rows: int, cols: int, std: float,
                     rng: np.random.Generator) -> np.ndarray:
    """A ``[rows, cols]`` weight of about ``std`` as ``qtype``'s blocks (``uint8`` rows): gguf-py
    quantizes normal values for the legacy types; the K-quants, which it cannot quantize, are
    random super-blocks whose fp16 scales are set for that spread."""
    from gguf import GGML_QUANT_SIZES, quants

    if qtype not in K_SCALE_FIELDS:
        return quants.quantize((rng.standard_normal((rows, cols)) * std).astype(np.float32), qtype)
    block_len, block_bytes = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, cols // block_len, block_bytes), dtype=np.uint8)
    d_at, dmin_at, ratio = K_SCALE_FIELDS[qtype]

    def scaled(d: float) -> np.ndarray:
        out = blocks.copy()
        out[..., d_at:d_at + 2] = np.array([d], np.float16).view(np.uint8)
        if dmin_at is not None:
            out[..., dmin_at:dmin_at + 2] = np.array([d * ratio], np.float16).view(np.uint8)
        return out.reshape(rows, -1)

    return scaled(std / float(quants.dequantize(scaled(1.0), qtype).std()))


def tiny_model_tensors(types: dict[str, GGMLQuantizationType], hidden: int = 256, ffn: int = 512,
                       seed: int = 0) -> dict[str, tuple[np.ndarray, GGMLQuantizationType]]:
    """A whole Llama model for `write_gguf` (2 layers, 4 heads, 2 KV heads), its tensors quantized
    as ``types`` names them by llama.cpp name (``blk.0.attn_q.weight``; ``token_embd.weight``);
    the others Q8_0, the norms F32. Embeddings are tied unless ``types`` names ``output.weight``."""
    rng = np.random.default_rng(seed)
    kv = hidden // 2
    shapes = {"token_embd.weight": (len(byte_level_tokens()), hidden)}
    if "output.weight" in types:
        shapes["output.weight"] = shapes["token_embd.weight"]
    for layer in range(2):
        for part, shape in (("attn_q", (hidden, hidden)), ("attn_k", (kv, hidden)), ("attn_v", (kv, hidden)),
                            ("attn_output", (hidden, hidden)), ("ffn_gate", (ffn, hidden)),
                            ("ffn_up", (ffn, hidden)), ("ffn_down", (hidden, ffn))):
            shapes[f"blk.{layer}.{part}.weight"] = shape
    tensors = {}
    for name, (rows, cols) in shapes.items():
        qtype = types.get(name, GGMLQuantizationType.Q8_0)
        std = 0.1 if name in ("token_embd.weight", "output.weight") else 1 / np.sqrt(cols)
        tensors[name] = (quantized_blocks(qtype, rows, cols, std, rng), qtype)
    ones = (np.ones(hidden, np.float32), GGMLQuantizationType.F32)
    for layer in range(2):
        tensors[f"blk.{layer}.attn_norm.weight"] = tensors[f"blk.{layer}.ffn_norm.weight"] = ones
    tensors["output_norm.weight"] = ones
    return tensors


def round_inputs_to_q8_blocks(model) -> None:
    """Rounds each decoder linear layer's input per 32-element block to ``q * d``, ``d = max|x| /
    127``, ``q`` rounded half to even from ``x * (127 / max|x|)``, as the GGUF kernels do."""
    def hook(_module, inputs):
        blocks = inputs[0].unflatten(-1, (-1, 32))
        amax = blocks.abs().amax(-1, keepdim=True)
        q = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0))
        return ((q * (amax / 127)).flatten(-2),)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.register_forward_pre_hook(hook)
