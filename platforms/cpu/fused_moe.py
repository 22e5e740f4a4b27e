"""The CPU platform's kernel for the "fused_moe" op (routed experts of a
FusedMoE layer, model_registry/layers/fused_moe.py), float32 and bfloat16.

Two paths, by batch size:

- Decode sizes (at most DECODE_MAX_TOKENS tokens, and any size while a CPU
  graph is captured): a C kernel (csrc/fused_moe.c) that reads the routing
  from the tensors, groups each expert's tokens itself and streams each
  selected expert's weights once, row by row (AVX-512 where the CPU has
  it). A decode step is bound by that streaming; and since nothing is read
  on the host, a decode graph can record the step (the reference reads the
  expert counts with .tolist() and refuses capture, so a MoE model never
  had decode graphs).
- Larger batches (prefill): the reference's plan on prepacked weights:
  tokens sorted by expert, one pair of oneDNN GEMMs per expert that has
  tokens (each expert's matrices reordered once at build time, as the dense
  linears are: linear.py), the activation, and one weighted index_add_ in
  float32. Experts without tokens cost nothing. It reads the counts on the
  host, so it refuses capture. Prepacked, the grouped GEMMs took 0.56x the
  time of F.linear on the same weights at 32 tokens, 0.77x at 128 and
  0.9x at 512 (Qwen3-MoE-shaped bf16 layer, one thread); the price is a
  second copy of the expert weights, as for the dense linears.

Without a C compiler, or with `PAGEDLLM_CPU_MOE_KERNEL=0` (logged once),
every eager batch runs the grouped GEMMs, and a graph capture a
capture-safe torch formulation: each token's experts' weights gathered
with index_select and multiplied with bmm. That copies every selected
expert per token and keeps the copies in the graph, so it is for small
graphs only (GATHER_MAX_BYTES; a larger capture is refused, and decode
runs eagerly): on a Qwen3-MoE-shaped layer it took 2x the reference's time
at one token and 10-40x at 8-32.

No model_registry import (the layers import platforms/): the layer is read
by its attributes, and the activation is written out again below, the
same torch ops as the layer's `apply_activation`.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.platforms.cpu import linear as cpu_linear
from pagedllm.platforms.cpu.graph import is_capturing, kernel_call, refuse_capture
from pagedllm.platforms.cpu.kernel_build import load_library, prebuild_in_background

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "fused_moe.c"
# -ffp-contract=off: weight * y and the sum round as torch's two ops (the
# kernel's dot products use explicit FMAs).
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-fno-trapping-math", "-fopenmp",
          "-ffp-contract=off", "-shared", "-fPIC")
ENV_SWITCH = "PAGEDLLM_CPU_MOE_KERNEL"
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
ACTIVATIONS = {"silu": 0, "swigluoai": 1}
# Batches of at most this many tokens run on the decode path outside capture:
# on a Qwen3-MoE-shaped layer (32 experts, top-8, bf16, benchmarks/moe.py)
# the C kernel took half the grouped GEMMs' time at 8-12 tokens, about the
# same at 16-24 and 1.2x at 32, where each expert has several tokens and
# oneDNN's blocking wins.
DECODE_MAX_TOKENS = 16
MAX_TOP_K = 64  # the kernel's per-token sort buffer (csrc/fused_moe.c)
# Without the C kernel, a graph capture of at most this many bytes of
# gathered expert weights (T * k experts' w13 and w2, which the graph then
# keeps allocated) runs the torch gather; a larger one is refused.
GATHER_MAX_BYTES = 64 << 20

_I64, _PTR, _INT, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURE: list[Any] = [_INT, _PTR, _I64, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _INT, _F32, _F32,
              _PTR, _PTR, _PTR, _PTR]

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library, built if needed; None when it cannot be (logged once)."""
    library = load_library(SOURCE, CFLAGS, ENV_SWITCH, "CPU MoE decode kernel")
    if library is None:
        logger.info("CPU MoE decode kernel off: decode batches of MoE layers gather their experts' weights "
                    "in torch (%s=0 turns the kernel off; else see the build message above)", ENV_SWITCH)
        return None
    return declare(library)


def declare(library: ctypes.CDLL) -> ctypes.CDLL:
    """`library` with the kernel's signature declared."""
    library.fused_moe.restype, library.fused_moe.argtypes = None, _SIGNATURE
    return library


def activate(gate_up: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    """[N, 2I] (gate columns, then up columns) -> [N, I]: the layer's
    apply_activation, op for op (so bfloat16 rounds where it rounds)."""
    gate, up = gate_up.chunk(2, dim=-1)
    if activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * gate * torch.sigmoid(gate * alpha)


def supports(layer: nn.Module) -> bool:
    """A FusedMoE layer whose weights are float32 or bfloat16 CPU tensors,
    contiguous, biases (if any) of the same dtype."""
    w13, w2 = getattr(layer, "w13_weight", None), getattr(layer, "w2_weight", None)
    if not (isinstance(w13, torch.Tensor) and isinstance(w2, torch.Tensor)):
        return False
    tensors = [t for t in (w13, w2, getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None))
               if t is not None]
    return bool(w13.dtype in KERNEL_DTYPES and all(t.is_cpu and t.dtype == w13.dtype and t.is_contiguous()
                                                   for t in tensors)
                and getattr(layer, "activation", None) in ACTIVATIONS and getattr(layer, "top_k", 0) <= MAX_TOP_K)


class CpuFusedMoE:
    """The kernel bound to one layer: (x, topk_weights, topk_ids) -> out."""

    def __init__(self, layer: Any) -> None:  # a FusedMoE, read by its attributes
        self.layer = layer
        self.w13: torch.Tensor = layer.w13_weight.detach()
        self.w2: torch.Tensor = layer.w2_weight.detach()
        self.b13: torch.Tensor | None = None if layer.w13_bias is None else layer.w13_bias.detach()
        self.b2: torch.Tensor | None = None if layer.w2_bias is None else layer.w2_bias.detach()
        self.num_experts, self.hidden, self.inter = self.w2.shape
        self.expert_bytes = (self.w13[0].numel() + self.w2[0].numel()) * self.w13.element_size()
        self.activation: str = layer.activation
        self.alpha, self.limit = float(layer.swiglu_alpha), float(layer.swiglu_limit)
        self.gemm13, self.gemm2 = self._expert_gemms(self.w13), self._expert_gemms(self.w2)

    def _expert_gemms(self, weight: torch.Tensor) -> list[Callable[[torch.Tensor, torch.Tensor | None],
                                                                    torch.Tensor]]:
        """Each expert's (rows, bias) -> rows @ W_e.T + bias: prepacked oneDNN
        where it runs here (linear.py's probe), else F.linear."""
        if cpu_linear.onednn_linear_available(weight.dtype):
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, cpu_linear._PACK_BATCH_HINT) for w in weight]
            return [functools.partial(_prepacked, packed_weight) for packed_weight in packed]
        return [functools.partial(_plain, w) for w in weight]

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() or not self._takes(x, topk_weights, topk_ids):
            out: torch.Tensor = self.layer.forward_reference(x, topk_weights, topk_ids)
            return out
        capturing = is_capturing()
        if x.shape[0] <= DECODE_MAX_TOKENS or capturing:
            library = load()
            if library is not None:
                return self.decode_kernel(library, x, topk_weights.contiguous(), topk_ids.contiguous())
            if capturing and topk_ids.numel() * self.expert_bytes <= GATHER_MAX_BYTES:
                return self.decode_gathered(x, topk_weights, topk_ids)
        return self.grouped_gemms(x, topk_weights, topk_ids)

    def _takes(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> bool:
        return (x.dim() == 2 and x.dtype == self.w13.dtype and x.is_cpu and x.is_contiguous()
                and topk_weights.dtype == torch.float32 and topk_ids.dtype == torch.int64
                and topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == x.shape[0])

    def decode_kernel(self, library: ctypes.CDLL, x: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
        tokens, top_k = topk_ids.shape
        sums = torch.empty(tokens, self.hidden, dtype=torch.float32)
        act = torch.empty(tokens * top_k, self.inter, dtype=x.dtype)
        y = torch.empty(tokens * top_k, self.hidden, dtype=torch.float32)
        out = torch.empty(tokens, self.hidden, dtype=x.dtype)
        kernel_call(library.fused_moe, KERNEL_DTYPES[x.dtype], x, tokens, self.hidden, topk_weights, topk_ids,
                    top_k, self.w13, self.w2, self.b13, self.b2, self.num_experts, self.inter,
                    ACTIVATIONS[self.activation], self.alpha, self.limit, sums, act, y, out)
        return out

    def decode_gathered(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Capture-safe torch: each (token, expert) pair's weights gathered,
        one batched GEMV per matrix."""
        tokens, top_k = topk_ids.shape
        ids = topk_ids.flatten()
        rows = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # [T * k, H, 1]
        gate_up = _batched_gemv(self.w13.index_select(0, ids), rows, self.b13, ids)
        h = activate(gate_up, self.activation, self.alpha, self.limit)
        y = _batched_gemv(self.w2.index_select(0, ids), h.unsqueeze(-1), self.b2, ids)
        weighted = y.float().view(tokens, top_k, self.hidden) * topk_weights.unsqueeze(-1)
        return weighted.sum(dim=1).to(x.dtype)

    def grouped_gemms(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """Tokens sorted by expert, one GEMM pair per expert with tokens."""
        refuse_capture("the CPU MoE's grouped GEMMs size each expert's batch from host-side counts")
        top_k = topk_ids.shape[1]
        flat_ids = topk_ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // top_k
        rows = x.index_select(0, token_of)
        y = torch.empty(order.numel(), self.hidden, dtype=x.dtype)
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            b13 = None if self.b13 is None else self.b13[expert]
            b2 = None if self.b2 is None else self.b2[expert]
            h = activate(self.gemm13[expert](rows[start:start + count], b13), self.activation, self.alpha,
                         self.limit)
            y[start:start + count] = self.gemm2[expert](h, b2)
            start += count
        weighted = y.float() * topk_weights.flatten().index_select(0, order).unsqueeze(-1)
        out = torch.zeros(x.shape[0], self.hidden, dtype=torch.float32)
        return out.index_add_(0, token_of, weighted).to(x.dtype)


def _batched_gemv(weights: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None,
                  ids: torch.Tensor) -> torch.Tensor:
    """[S, N, K] @ [S, K, 1] (+ bias[ids]) -> [S, N]; the bias added before
    rounding, as F.linear adds it."""
    if bias is None:
        return torch.bmm(weights, rows).squeeze(-1)
    return torch.baddbmm(bias.index_select(0, ids).unsqueeze(-1), weights, rows).squeeze(-1)


def _prepacked(packed_weight: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")


def _plain(weight: torch.Tensor, rows: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(rows, weight, bias)


def build(layer: nn.Module) -> Kernel:
    prebuild_in_background(load)  # the compile overlaps the rest of the model's preparation
    with torch.no_grad():
        return CpuFusedMoE(layer)


IMPL_NAME = "cpu_moe"
PRIORITY = 10


def register_ops(register: Callable[..., None]) -> None:
    """Offer the kernel as the "fused_moe" op (model_registry/layers/ops.py)."""
    register("fused_moe", IMPL_NAME, build, priority=PRIORITY, supports=supports)
