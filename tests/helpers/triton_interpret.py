"""Runs the Triton kernels on the CPU through Triton's interpreter.

Import this before anything that imports ``ferrollm.kernels.triton``: ``triton.jit`` reads
``TRITON_INTERPRET`` when a kernel is defined, not when it runs.

The interpreter does not support bfloat16 arithmetic: it keeps bfloat16 tensors as their uint16
bit patterns. Our kernels only load, store and convert bfloat16, doing all arithmetic in float32,
except ``tl.dot``, and two interpreter gaps remain that this module closes so bfloat16 kernels can
be checked against torch bit for bit where the GPU would agree:

- ``tl.dot`` multiplies the bit patterns (triton-lang/triton#11584, closed as unsupported):
  bfloat16 operands are widened to float32 first, which is what the GPU's bf16 MMA computes
  (exact products, float32 accumulation).
- float32 -> bfloat16 casts truncate, where the GPU (and torch) round to nearest even; integer
  -> bfloat16 casts store the integer itself as the bit pattern. Both now round the value to
  nearest even, integers through float32 (exact for the quantized kernels' codes).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

_original_create_dot = interpreter.InterpreterBuilder.create_dot


def _bf16_as_fp32(handle: interpreter.TensorHandle) -> interpreter.TensorHandle:
    if handle.dtype.scalar != tl.bfloat16:
        return handle
    widened = (handle.data.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return interpreter.TensorHandle(widened, tl.float32)


def _dot_with_bf16_as_fp32(self, a, b, d, input_precision, max_num_imprecise_acc):
    return _original_create_dot(self, _bf16_as_fp32(a), _bf16_as_fp32(b), d, input_precision,
                                max_num_imprecise_acc)


interpreter.InterpreterBuilder.create_dot = _dot_with_bf16_as_fp32


_original_cast_impl = interpreter.InterpreterBuilder.cast_impl


def _cast_rounding_to_nearest_even(self, src, dst_type):
    if dst_type.scalar == tl.bfloat16 and src.dtype.scalar.is_int():
        src = interpreter.TensorHandle(src.data.astype(np.float32), tl.float32)
    if not (src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16):
        return _original_cast_impl(self, src, dst_type)
    bits = np.ascontiguousarray(src.data, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    quiet_nan = (bits >> np.uint32(16)) | np.uint32(0x0040)
    out = np.where(np.isnan(src.data), quiet_nan, rounded).astype(np.uint16)
    return interpreter.TensorHandle(out, tl.bfloat16)


interpreter.InterpreterBuilder.cast_impl = _cast_rounding_to_nearest_even
