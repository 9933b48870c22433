"""Reading llama.cpp GGUF files: the HF config the file describes and a stream of HF-named
tensors, in the order ``load_weights`` consumes them.

The file is parsed once per process (`gguf_reader`, cached), the config is built from that parse
with transformers' tables (`gguf_config`), and the tensors are decoded by the Rust block decoders
(`ferrollm.kernels.cpu.gguf`). Measured on the 2-core development machine for the 94 MiB Q4_1
SmolLM2-135M file: the parse ~0.1 s, the config a few ms (plus ~1.3 s importing transformers'
Llama config, as for any checkpoint), the dequantization 0.15-0.35 s, most of it first touches of
the 513 MiB of float32 weights. Before, transformers and gguf-py parsed the file three times here
(4-7 s each) and gguf-py's numpy dequantized it in ~2 s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from transformers import PretrainedConfig

from ferrollm.exceptions import CheckpointError, UnsupportedModelError
from ferrollm.model_executor.gguf_config import gguf_config
from ferrollm.model_executor.ggml_types import block_size, type_name
from ferrollm.model_executor.gguf_reader import GGUFFile, GGUFTensorInfo, open_gguf
from ferrollm.model_executor.layers.cpu_weights import release_pages
from ferrollm.model_executor.layers.quantization.gguf import GGUFConfig
from ferrollm.model_executor.layers.quantization.qweights import GGUFWeight
from ferrollm.model_executor.weight_utils import shareable

__all__ = ["gguf_to_hf_name", "load_gguf"]

logger = logging.getLogger(__name__)

_GGML_F32 = 0


def load_gguf(path: str | Path, quant_config: GGUFConfig | None = None,
              device: torch.device | None = None) -> tuple[PretrainedConfig, Iterator[tuple[str, torch.Tensor]]]:
    """Opens a llama.cpp GGUF file as an HF config and a stream of HF-named float tensors.

    The config is the one ``AutoConfig.from_pretrained(folder, gguf_file=name)`` builds (see
    `gguf_config`). Quantized tensors are dequantized to float32; float32 tensors are views of
    the file's private mapping. llama.cpp stores Llama's q/k projection rows interleaved per
    head for its rotary kernel; they are put back in HF's half-split order.

    Args:
        path: the ``.gguf`` file.
        quant_config: keeps the projections it `GGUFConfig.keeps` as llama.cpp blocks
            (`qweights.GGUFWeight`, views of the mapping); None dequantizes every tensor.
        device: where the model runs.

    Returns:
        ``(config, weights)``; ``weights`` decodes the tensors as it is iterated.

    Raises:
        CheckpointError: if the file does not exist or is not a readable GGUF file.
        UnsupportedModelError: if transformers knows no causal-LM class for the file's model type.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {str(path)!r} does not exist")
    gguf = open_gguf(path)
    start = time.perf_counter()
    config = gguf_config(gguf)
    # AutoConfig.from_pretrained names the folder it was given.
    config.name_or_path = str(path.parent)
    logger.info("GGUF config of %s built in %.3f s", path.name, time.perf_counter() - start)
    if quant_config is not None:
        names = {gguf_to_hf_name(t.name): t.ggml_type for t in gguf.tensors}
        quant_config.bind({n: t for n, t in names.items() if n is not None}, device or torch.device("cpu"))
    return config, _iterate_gguf(gguf, config, quant_config)


# llama.cpp's per-layer tensor names -> HF's (Llama-style architectures).
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp derives from the config (Llama 3's rope_freqs); the model recomputes them.
_GGUF_SKIPPED = {"rope_freqs"}
# GGUF architectures whose q/k rows llama.cpp's converter permuted.
_GGUF_PERMUTED_ARCHS = {"llama"}


def gguf_to_hf_name(name: str) -> str | None:
    """HF name of a llama.cpp tensor name (``blk.3.attn_q.weight`` -> ``model.layers.3.
    self_attn.q_proj.weight``), or ``None`` for tensors HF models do not have."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GGUF_SKIPPED:
        return None
    if stem in _GGUF_GLOBAL_NAMES:
        return f"{_GGUF_GLOBAL_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{suffix}"
    raise CheckpointError(f"GGUF tensor {name!r} has no known HF name")


def _iterate_gguf(gguf: GGUFFile, config: PretrainedConfig,
                  quant_config: GGUFConfig | None) -> Iterator[tuple[str, torch.Tensor]]:
    from ferrollm.kernels.cpu.gguf import dequantize_supported

    slow = sorted({type_name(t.ggml_type) for t in gguf.tensors
                   if t.ggml_type != _GGML_F32 and not dequantize_supported(t.ggml_type)})
    if slow:
        logger.info("GGUF tensor types %s have no Rust decoder: gguf-py's numpy code dequantizes them (slow)", slow)
    permuted = gguf.architecture in _GGUF_PERMUTED_ARCHS
    seconds, count = 0.0, 0
    for info in gguf.tensors:
        hf_name = gguf_to_hf_name(info.name)
        if hf_name is None:
            continue
        start = time.perf_counter()
        if quant_config is not None and quant_config.keeps(hf_name):
            blocks = _blocks(gguf, info)
            if permuted:
                blocks.data = _unpermute_qk(info.name, blocks.data, config)
            yield hf_name, blocks  # type: ignore[misc]
            continue
        weight = _read_tensor(gguf, info)
        if permuted:
            weight = _unpermute_qk(info.name, weight, config)
        seconds, count = seconds + time.perf_counter() - start, count + 1
        # Fresh tensors, or views of the file's private mapping: parameters may keep either.
        yield hf_name, shareable(weight)
    logger.info("GGUF tensors of %s: %d dequantized or mapped in %.2f s", gguf.path.name, count, seconds)


def _blocks(gguf: GGUFFile, info: GGUFTensorInfo) -> GGUFWeight:
    """A 2-D tensor's blocks as the file holds them: a uint8 ``[rows, row_bytes]`` view of the mapping."""
    block_len, block_bytes = block_size(info.ggml_type)
    rows, in_features = info.shape
    data = torch.from_numpy(gguf.tensor_bytes(info).reshape(rows, -1))
    return GGUFWeight(data, info.ggml_type, in_features, block_len, block_bytes)


def _read_tensor(gguf: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    """One tensor as float32: a view of the mapping for F32, else decoded."""
    from ferrollm.kernels.cpu.gguf import dequantize, dequantize_supported

    data = gguf.tensor_bytes(info)
    if info.ggml_type == _GGML_F32:
        return torch.from_numpy(data.view(np.float32).reshape(info.shape))
    if dequantize_supported(info.ggml_type):
        weight = dequantize(data, info.ggml_type, info.shape)
    else:
        weight = torch.from_numpy(_numpy_dequantize(data, info))
    # The decoded copy is the one kept: hand back the file pages the decoding read.
    release_pages(torch.from_numpy(data))
    return weight


def _numpy_dequantize(data: np.ndarray, info: GGUFTensorInfo) -> np.ndarray:
    import gguf

    qtype = gguf.GGMLQuantizationType(info.ggml_type)
    try:
        array = gguf.quants.dequantize(data.reshape(*info.shape[:-1], -1), qtype)
    except NotImplementedError as e:
        raise CheckpointError(f"GGUF tensor {info.name!r} has type {qtype.name}, which cannot be dequantized: {e}") from e
    return np.ascontiguousarray(array, dtype=np.float32).reshape(info.shape)


def _unpermute_qk(name: str, weight: torch.Tensor, config: PretrainedConfig) -> torch.Tensor:
    """Undoes llama.cpp's q/k row order: within each head it stores rows as interleaved pairs
    (first-half row i, second-half row i) where HF keeps the two halves apart."""
    if ".attn_q." in name:
        num_heads = config.num_attention_heads
    elif ".attn_k." in name:
        num_heads = config.num_key_value_heads
    else:
        return weight
    rows = weight.shape[0]
    per_head = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return per_head.transpose(1, 2).reshape(weight.shape).contiguous()
