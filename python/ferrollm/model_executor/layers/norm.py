"""Normalisations: RMSNorm (Llama's, and Gemma's ``1 + weight`` flavour) with the residual add
fused in, and LayerNorm (GPT-2, OPT, GPT-NeoX)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ferrollm.kernels import cpu as cpu_kernels

__all__ = ["GemmaRMSNorm", "LayerNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, ``weight * x / sqrt(mean(x^2) + eps)``, computed in float32.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
        params_dtype: dtype of ``weight`` (default: torch's default dtype).
    """

    # Gemma's flavour (`GemmaRMSNorm`), for the CPU kernel, which does both.
    _gemma = False

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None):
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalises ``x``, or ``x + residual`` when a residual is given.

        Args:
            x: ``[..., hidden_size]``.
            residual: the running residual stream, same shape as ``x``.

        Returns:
            The normalised tensor; with a residual, ``(normalised, x + residual)`` so the decoder
            layer carries the sum on without a separate add.
        """
        if cpu_kernels.supports(x, self.weight, *(() if residual is None else (residual,))):
            return self._normalize_cpu(x, residual)
        if residual is not None:
            x = x + residual
            residual = x
        out = self._normalize(x)
        return out if residual is None else (out, residual)

    def _normalize_cpu(self, x: torch.Tensor, residual: torch.Tensor | None):
        """`forward` in one pass of the Rust kernel (`ferrollm.kernels.cpu`)."""
        if residual is None:
            return cpu_kernels.rms_norm(x, self.weight, self.variance_epsilon, self._gemma)
        return cpu_kernels.fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon, self._gemma)

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        # Llama rounds to the input dtype before the weight multiplies.
        return self.weight * h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, all in float32 and rounded
    to the input dtype at the end; checkpoints store the offset from 1 as ``weight``.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
        params_dtype: dtype of ``weight``.
    """

    _gemma = True

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None):
        super().__init__(hidden_size, eps, params_dtype)
        with torch.no_grad():
            self.weight.zero_()

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class LayerNorm(nn.Module):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dimension, as ``nn.LayerNorm``.

    Replicated on every rank. Parameters are only created when the checkpoint has them, so
    ``load_weights`` can insist on every parameter being filled.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the variance.
        params_dtype: dtype of ``weight`` and ``bias``.
        elementwise_affine: whether there is a learned ``weight`` (OPT's
            ``layer_norm_elementwise_affine``).
        bias: whether there is a learned ``bias`` (only with ``elementwise_affine``).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-5, params_dtype: torch.dtype | None = None,
                 elementwise_affine: bool = True, bias: bool = True):
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(hidden_size, dtype=params_dtype), requires_grad=False)
        else:
            self.register_parameter("weight", None)
        if elementwise_affine and bias:
            self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype), requires_grad=False)
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, affine={self.weight is not None}"
