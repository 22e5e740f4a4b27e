"""RMSNorm (Zhang & Sennrich, 2019), computed in float32 like the HF reference;
Gemma's (1 + w) variant."""

from __future__ import annotations

import torch
from torch import nn

from pagedllm.model_registry.layers.ops import RMS_NORM, OpLayer


class RMSNorm(nn.Module, OpLayer):
    op_name = RMS_NORM

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_fp32.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with ``residual``: (norm(x + residual), x + residual)."""
        kernel = self.op_kernel
        if kernel is not None:
            fused = kernel(x, residual, self.weight, self.eps)
            if fused is not None:
                return fused
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + w), with w stored as the checkpoint
    holds it (zero-centred). Multiplied in float32 and cast once at the end,
    as transformers' Gemma2RMSNorm / Gemma3RMSNorm do (Llama's RMSNorm casts
    before it multiplies). The fused-residual interface is RMSNorm's.

    NOTE: not an op layer of "rms_norm": that op's kernels compute
    weight * norm(x), which is not this. Storing 1 + w at load time would let
    them run, but the loaded weights would no longer be the checkpoint's (the
    conformance kit's round trip checks they are), and in bfloat16 1 + w
    rounds away the low bits of w that transformers keeps in float32.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(hidden_size))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_fp32 * (1.0 + self.weight.float())).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with ``residual``: (norm(x + residual), x + residual)."""
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual
