"""Optional torch.compile of a model, attention left out (`device.compile_model`).

The layers around attention (norms, projections, rotary embedding, MLP) are
what the compiler fuses well. Paged attention stays eager: its metadata is
rebuilt every step from host values and its kernels are already fused, so
each Attention.forward is a graph break and the compiled pieces are shared
across batch shapes (`dynamic=True`).

Measured on the ~100M Llama in bfloat16 (throughput workload, 32 prompts
of 64-256 tokens x 64 tokens, one thread, CPU time, loaded 2-core machine):
one generate took 0.88x the time of eager mode with the CPU decode kernel
(5.12 s vs 5.84 s), but the first forward compiles for ~55 s (~5 s with
Inductor's on-disk cache warm), so it stays opt-in: `pagedllm serve` must
answer its first request within 3 s. Inductor's `freezing` was slower here
(6.2 s per generate, ~140 s to compile).
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
