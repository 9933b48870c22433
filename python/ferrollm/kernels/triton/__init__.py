"""Triton kernels for the GPU hot path, each beside the torch reference it is tested against.

Importing this package needs Triton (shipped with CUDA builds of torch); nothing outside the
Triton attention backend imports it, so CPU-only installs never do. The tests run every kernel on
the CPU with ``TRITON_INTERPRET=1``.
"""

from ferrollm.kernels.triton.activation import silu_and_mul, silu_and_mul_ref
from ferrollm.kernels.triton.attention import (
    paged_attention_decode,
    paged_attention_decode_ref,
    paged_attention_prefill,
    paged_attention_prefill_ref,
)
from ferrollm.kernels.triton.cache import reshape_and_cache, reshape_and_cache_ref
from ferrollm.kernels.triton.norm import fused_add_rms_norm, fused_add_rms_norm_ref, rms_norm, rms_norm_ref
from ferrollm.kernels.triton.quant import (
    fp8_linear,
    fp8_linear_ref,
    has_fp8_dot,
    scaled_fp8_quant,
    scaled_fp8_quant_ref,
    scaled_int8_quant,
    scaled_int8_quant_ref,
    w8a8_linear,
    w8a8_linear_ref,
    wq_linear,
    wq_linear_ref,
)
from ferrollm.kernels.triton.rotary import rotary_embedding, rotary_embedding_ref

__all__ = [
    "fp8_linear",
    "fp8_linear_ref",
    "fused_add_rms_norm",
    "fused_add_rms_norm_ref",
    "has_fp8_dot",
    "paged_attention_decode",
    "paged_attention_decode_ref",
    "paged_attention_prefill",
    "paged_attention_prefill_ref",
    "reshape_and_cache",
    "reshape_and_cache_ref",
    "rms_norm",
    "rms_norm_ref",
    "rotary_embedding",
    "rotary_embedding_ref",
    "scaled_fp8_quant",
    "scaled_fp8_quant_ref",
    "scaled_int8_quant",
    "scaled_int8_quant_ref",
    "silu_and_mul",
    "silu_and_mul_ref",
    "w8a8_linear",
    "w8a8_linear_ref",
    "wq_linear",
    "wq_linear_ref",
]
