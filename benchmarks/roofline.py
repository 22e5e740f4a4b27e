"""How far from the hardware: a generation workload's FLOPs from the model's
shape, and this machine's peak measured by a large GEMM in the same dtype.

FLOPs count what a decoder forward must compute, whatever the engine:
every token fed to the model (the prompt, then each generated token but the
last) costs 2 FLOPs per weight of the linear layers and the LM head (the
embedding is a lookup), plus attention's two matmuls over the positions it
sees (QK^T and PV: 4 x query heads x head size per key per layer). Padding,
recomputation after preemption and speculative drafts are not counted: they
are the engine's overhead, not the workload.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int

    @classmethod
    def from_folder(cls, model_path: str | Path) -> ModelShape:
        config = json.loads((Path(model_path) / "config.json").read_text())
        num_heads = config["num_attention_heads"]
        hidden = config["hidden_size"]
        return cls(
            hidden_size=hidden,
            intermediate_size=config["intermediate_size"],
            num_layers=config["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads", num_heads),
            head_dim=config.get("head_dim") or hidden // num_heads,
            vocab_size=config["vocab_size"],
        )

    @property
    def matmul_weights(self) -> int:
        """Weights a token multiplies: q, k, v, o and the gated MLP per layer, and the LM head."""
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        mlp = 3 * h * self.intermediate_size
        return self.num_layers * (attention + mlp) + h * self.vocab_size

    def attention_flops(self, num_keys: int) -> int:
        """One token's attention over `num_keys` positions, every layer."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * num_keys


def generation_flops(shape: ModelShape, prompt_lens: list[int], num_new_tokens: int) -> int:
    """FLOPs of generating `num_new_tokens` after each prompt (see the module doc)."""
    total = 0
    for prompt_len in prompt_lens:
        num_fed = prompt_len + num_new_tokens - 1
        total += 2 * shape.matmul_weights * num_fed
        # Position p (0-based) attends to p + 1 keys: sum over p < num_fed.
        total += shape.attention_flops(num_fed * (num_fed + 1) // 2)
    return total


def measure_peak_flops(dtype: torch.dtype, size: int = 2048, reps: int = 5) -> float:
    """The best FLOP/s of a size x size x size matmul in `dtype` on this
    process's threads (a warm-up first): what the GEMM library reaches."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


__all__ = ["ModelShape", "generation_flops", "measure_peak_flops"]
