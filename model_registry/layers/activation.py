"""Gated MLP activations over a stacked [gate | up] projection: SwiGLU and
GeGLU (Shazeer, 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_registry.layers.ops import SILU_AND_MUL, OpLayer


class SiluAndMul(nn.Module, OpLayer):
    op_name = SILU_AND_MUL

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        kernel = self.op_kernel
        if kernel is not None and (fused := kernel(gate_up)) is not None:
            return fused
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """GeGLU's gate (Shazeer, 2020): gelu(gate) * up over a stacked
    [gate | up] projection. `approximate` is torch's: "tanh" (transformers'
    gelu_pytorch_tanh, Gemma's) or "none" (the erf GELU)."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up
