"""RMSNorm (Llama's, and Gemma's ``1 + weight`` flavour) with the residual add fused in."""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["GemmaRMSNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square layer norm, ``weight * x / sqrt(mean(x^2) + eps)``, computed in float32.

    Args:
        hidden_size: size of the last dimension.
        eps: added to the mean square.
        params_dtype: dtype of ``weight`` (default: torch's default dtype).
    """

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
        if residual is not None:
            x = x + residual
            residual = x
        out = self._normalize(x)
        return out if residual is None else (out, residual)

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

    def __init__(self, hidden_size: int, eps: float = 1e-6, params_dtype: torch.dtype | None = None):
        super().__init__(hidden_size, eps, params_dtype)
        with torch.no_grad():
            self.weight.zero_()

    def _normalize(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
