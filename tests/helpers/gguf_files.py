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
               name: str = "tiny", alignment: int | None = None) -> Path:
    """Writes a GGUF file: hidden size 64, 2 layers, 4 heads (2 KV heads) and the byte-level
    tokenizer; ``tensors`` maps llama.cpp names to ``(array, type)``, where a quantized type's
    array holds its blocks as ``uint8`` rows."""
    tokens = byte_level_tokens()
    writer = GGUFWriter(path, arch)
    writer.add_name(name)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_context_length(256)
    writer.add_embedding_length(64)
    writer.add_block_count(2)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(10000.0)
    writer.add_rope_dimension_count(16)
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
