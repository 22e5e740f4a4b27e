"""Optional torch.compile of a model, attention left out (`device.compile_model`).

The layers around attention (norms, projections, rotary embedding, MLP) are
what the compiler fuses well. Paged attention stays eager: its metadata is
rebuilt every step from host values and its kernels are already fused, so
each Attention.forward is a graph break and the compiled pieces are shared
across batch shapes (`dynamic=True`).

It stays opt-in: the first forward compiles for far longer than the 3 s in
which `pagedllm serve` must answer its first request, for a modest gain
per generate afterwards (the measurement: docs/performance.md,
"torch.compile").
"""

from __future__ import annotations

import torch

from pagedllm.model_registry.layers.attention import Attention


def compile_outside_attention(model: torch.nn.Module, backend: str = "inductor") -> torch.nn.Module:
    """Compile `model.forward` in place; returns the model."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.forward = torch.compiler.disable(module.forward)  # type: ignore[method-assign]
    model.forward = torch.compile(model.forward, dynamic=True, backend=backend)
    return model
