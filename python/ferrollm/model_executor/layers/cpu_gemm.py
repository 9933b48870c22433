"""The CPU matmul path: oneDNN with each weight packed once, after loading.

PyTorch's `F.linear` goes to MKL, which streams weights slowly when few rows multiply them, the
decode case. Measured on the 2-core AVX-512 development machine (fp32, 2 threads): a [9728, 896]
gate/up weight at 1 row takes 2.8 ms through MKL and 1.2 ms through oneDNN with the weight
prepacked (29 GB/s, the memory roofline); at 8 rows 4.9 vs 2.9 ms; at 512 rows they tie. The
151936-word LM head goes from 50 to 20 ms per batch-1 step. So on the CPU, in fp32, every linear
layer runs through oneDNN; `FERROLLM_CPU_ONEDNN=0` turns this off.

The packed copy sits beside the dense weight, which stays for embeddings tied to the LM head,
checkpoint saving and tensor-parallel loading.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedWeight", "linear", "onednn_enabled", "pack_linear_weights"]


def onednn_enabled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether layers on `device` in `dtype` should use packed oneDNN weights."""
    return (device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
            and os.environ.get("FERROLLM_CPU_ONEDNN", "1") != "0")


class PackedWeight:
    """A weight (and bias) in oneDNN's blocked layout, packed once."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        self.weight = weight.detach().contiguous().to_mkldnn()
        if bias is None:
            bias = torch.zeros(weight.shape[0], dtype=torch.float32)
        self.bias = bias.detach().float().contiguous().to_mkldnn()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: PackedWeight | None) -> torch.Tensor:
    """`x @ weight.T + bias`, through the packed weight when there is one."""
    if packed is None or x.dim() != 2 or x.shape[0] == 0 or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), packed.weight, packed.bias).to_dense()


def pack_linear_weights(model: nn.Module) -> int:
    """Packs every layer that supports it (those with a `pack_for_cpu` method); returns how many."""
    count = 0
    for module in model.modules():
        pack = getattr(module, "pack_for_cpu", None)
        if callable(pack):
            pack()
            count += 1
    return count
