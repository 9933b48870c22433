"""Quantized matmuls for the GPU: weight-only int4/int8, W8A8 int8 and FP8, and the activation
quantizers they use, each beside its torch reference.

- :mod:`.weight_only`: :func:`wq_linear`, int4/int8 codes with group scales (and mins);
- :mod:`.int8`: :func:`w8a8_linear`, int8 x int8 -> int32 on the tensor cores;
- :mod:`.fp8`: :func:`fp8_linear`, float8 e4m3fn weights, float8 tensor cores on sm_89+;
- :mod:`.activations`: :func:`scaled_int8_quant`, :func:`scaled_fp8_quant`;
- :mod:`._common`: exact rounding and e4m3 conversion in registers, checks, tile sizes.
- :mod:`._split_k`: splitting K over more programs at decode, where the column tiles alone
  leave SMs idle, and the reduction of the partial sums.
"""

from ferrollm.kernels.triton.quant.activations import (
    scaled_fp8_quant,
    scaled_fp8_quant_ref,
    scaled_int8_quant,
    scaled_int8_quant_ref,
)
from ferrollm.kernels.triton.quant.fp8 import fp8_linear, fp8_linear_ref, has_fp8_dot
from ferrollm.kernels.triton.quant.int8 import w8a8_linear, w8a8_linear_ref
from ferrollm.kernels.triton.quant.weight_only import wq_linear, wq_linear_ref

__all__ = [
    "fp8_linear",
    "fp8_linear_ref",
    "has_fp8_dot",
    "scaled_fp8_quant",
    "scaled_fp8_quant_ref",
    "scaled_int8_quant",
    "scaled_int8_quant_ref",
    "w8a8_linear",
    "w8a8_linear_ref",
    "wq_linear",
    "wq_linear_ref",
]
