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
    # Mixture-of-experts: the MLP weights one token multiplies, summed over
    # the layers (router, its top-k experts, a shared expert and its gate;
    # dense layers whole). None: every layer's MLP is dense, of intermediate_size.
    mlp_weights: int | None = None

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
            mlp_weights=_moe_mlp_weights(config),
        )

    @property
    def matmul_weights(self) -> int:
        """Weights a token multiplies: q, k, v, o and the gated MLP per layer, and the LM head."""
        h, d = self.hidden_size, self.head_dim
        attention = h * self.num_heads * d * 2 + h * self.num_kv_heads * d * 2
        if self.mlp_weights is None:
            return self.num_layers * (attention + 3 * h * self.intermediate_size) + h * self.vocab_size
        return self.num_layers * attention + self.mlp_weights + h * self.vocab_size

    def attention_flops(self, num_keys: int) -> int:
        """One token's attention over `num_keys` positions, every layer."""
        return 4 * self.num_layers * self.num_heads * self.head_dim * num_keys


def _moe_mlp_weights(config: dict) -> int | None:
    """ModelShape.mlp_weights of a Qwen2/3-MoE or Mixtral config.json; None
    for a dense model. Qwen-MoE's rule for which layers are sparse."""
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if not num_experts or "num_experts_per_tok" not in config:
        return None
    h, top_k = config["hidden_size"], config["num_experts_per_tok"]
    expert_width = config.get("moe_intermediate_size") or config["intermediate_size"]
    sparse = h * num_experts + 3 * h * top_k * expert_width
    if config.get("shared_expert_intermediate_size"):
        sparse += 3 * h * config["shared_expert_intermediate_size"] + h
    dense_layers = set(config.get("mlp_only_layers") or [])
    step = config.get("decoder_sparse_step") or 1
    return sum(
        3 * h * config["intermediate_size"] if i in dense_layers or (i + 1) % step else sparse
        for i in range(config["num_hidden_layers"])
    )


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
