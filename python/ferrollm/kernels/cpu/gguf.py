"""GGUF tensors to floats with the Rust block decoders (``rust/kernels/src/quant.rs``).

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F16 and BF16 decode on torch's OpenMP team, bit
for bit as gguf-py's numpy ``gguf.quants.dequantize`` does (which stays the reference the tests
compare against, and the path for the other GGML types). For the 135M-parameter Q4_1 SmolLM2
file that is ~0.3 s instead of ~2 s on the 2-core development machine.
"""

from __future__ import annotations

import numpy as np
import torch

from ferrollm import _core
from ferrollm.kernels.cpu import _threads
from ferrollm.exceptions import KernelError

__all__ = ["dequantize", "dequantize_supported"]

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}


def dequantize_supported(ggml_type: int) -> bool:
    """Whether :func:`dequantize` decodes tensors of this GGML type id."""
    return _core.cpu_gguf_supported(int(ggml_type))


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Decodes one GGUF tensor.

    Args:
        data: the tensor's stored bytes, a C-contiguous ``uint8`` array (a view of the file).
        ggml_type: its GGML type id; see :func:`dequantize_supported`.
        shape: its shape in torch order.
        dtype: ``torch.float32`` or ``torch.bfloat16``.

    Returns:
        A fresh tensor of ``shape`` and ``dtype``.

    Raises:
        KernelError: for another type or dtype, or bytes that are not whole blocks of ``shape``.
    """
    if dtype not in _DTYPES:
        raise KernelError(f"`dtype` must be torch.float32 or torch.bfloat16. Given: {dtype}")
    if data.dtype != np.uint8 or not data.flags.c_contiguous:
        raise KernelError(f"`data` must be a C-contiguous uint8 array. Given: {data.dtype}, "
                          f"contiguous={data.flags.c_contiguous}")
    out = torch.empty(shape, dtype=dtype)
    address = data.__array_interface__["data"][0]
    # `data` and `out` stay referenced here until the kernel returns.
    _core.cpu_gguf_dequantize(int(ggml_type), (address, data.nbytes), _DTYPES[dtype],
                              (out.data_ptr(), out.numel()), _threads())
    return out
