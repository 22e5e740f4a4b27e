"""The op registry: which implementation runs a layer's op.

A layer that computes an op (linear, RMSNorm, SwiGLU's SiLU * mul, rotary
embedding, MoE experts, LoRA; later attention) is an `OpLayer`. Its own
torch code is the reference, and it runs until something better is bound.
When a model is prepared for a platform and dtype (after its weights are
loaded and quantized, before any forward), `bind_layer_ops` asks the
registry ONCE per layer which implementation runs its op, and the layer
keeps the answer. Nothing patches a built module or swaps a global at run
time: a registry is built per model preparation, and an implementation
registered later changes no layer that is already bound.

Implementations are registered with a name, a priority and a `supports`
predicate over the layer (its weight's dtype, device, shape), by the
platform (`Platform.register_layer_ops`), by the quantization method
(`QuantizationMethod.register_layer_ops`) and, through either of those, by
plugins. The highest priority that supports the layer wins; ties go to the
first registered. A bound kernel computes what the layer's torch code
computes, to rounding.

Op names and what `build(layer)` returns (the kernel the layer calls):

- "linear": (x, bias) -> x @ weight.T + bias; the layer's GEMM
  (`LinearBase.apply_linear`), its collectives stay outside
- "rms_norm": (x, residual | None, weight, eps) -> out | (out, x + residual)
- "silu_and_mul": (gate_up) -> out
- "rotary_embedding": (x [T, heads, head_size], cos, sin) -> x rotated; may
  rotate x in place and return it
- "fused_moe": (x [T, H], topk_weights float32 [T, k], topk_ids int64
  [T, k]) -> [T, H] in x's dtype, this rank's sum over each token's experts
  (`FusedMoE.forward_reference`, layers/fused_moe.py); the router before it
  and the all-reduce after it stay in the layer
- "lora": (y [T, out], x [T, in], token_slots int32 [T]) -> None, adds each
  row's adapter product into y in place (`lora_reference`, layers/lora.py);
  the layer is a `LoRASlots`, its stacked `lora_a` / `lora_b` the weights

An elementwise kernel (all but "linear", "fused_moe" and "lora") returns None for inputs it does not
take (another layout, or while torch.compile traces), and the layer's torch
code runs.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
from torch import nn

logger = logging.getLogger(__name__)

LINEAR = "linear"
RMS_NORM = "rms_norm"
SILU_AND_MUL = "silu_and_mul"
ROTARY_EMBEDDING = "rotary_embedding"
FUSED_MOE = "fused_moe"
LORA = "lora"
OP_NAMES = (LINEAR, RMS_NORM, SILU_AND_MUL, ROTARY_EMBEDDING, FUSED_MOE, LORA)
# The name a layer reports while its own torch code runs.
REFERENCE = "torch"

Kernel = Callable[..., Any]
# Kernels of the deprecated op_kernels.register_op_kernel (plugin API 1.x),
# offered to each registry as it is built.
LEGACY_KERNELS: dict[str, Kernel] = {}
LEGACY_PRIORITY = -100


class OpImpl(NamedTuple):
    op: str
    name: str
    build: Callable[[nn.Module], Kernel]  # the layer -> the kernel it calls
    priority: int
    supports: Callable[[nn.Module], bool]


def _always(layer: nn.Module) -> bool:
    return True


def _same_for_every_layer(kernel: Kernel) -> Callable[[nn.Module], Kernel]:
    def build(layer: nn.Module) -> Kernel:
        return kernel

    return build


class OpRegistry:
    """Implementations per op; `register` is what platforms and
    quantization methods are handed."""

    def __init__(self) -> None:
        self._impls: dict[str, list[OpImpl]] = {op: [] for op in OP_NAMES}
        for op, kernel in LEGACY_KERNELS.items():
            self.register(op, "legacy", _same_for_every_layer(kernel), priority=LEGACY_PRIORITY)

    def register(
        self,
        op: str,
        name: str,
        build: Callable[[nn.Module], Kernel],
        *,
        priority: int = 0,
        supports: Callable[[nn.Module], bool] | None = None,
    ) -> None:
        """Offer `build(layer)` for `op` on the layers `supports` accepts."""
        if op not in self._impls:
            raise ValueError(f"unknown layer op {op!r}; known: {', '.join(OP_NAMES)}")
        if name == REFERENCE or any(impl.name == name for impl in self._impls[op]):
            raise ValueError(f"op {op!r} already has an implementation named {name!r}")
        self._impls[op].append(OpImpl(op, name, build, priority, supports or _always))

    def implementations(self, op: str) -> list[OpImpl]:
        """`op`'s implementations, the one tried first first."""
        return sorted(self._impls[op], key=lambda impl: -impl.priority)

    def select(self, op: str, layer: nn.Module) -> OpImpl | None:
        """The implementation that runs `op` for `layer`; None: its torch code."""
        return next((impl for impl in self.implementations(op) if impl.supports(layer)), None)


class OpLayer:
    """A module whose op the registry may route (mixed into an nn.Module)."""

    op_name: ClassVar[str]
    op_impl: str = REFERENCE  # the bound implementation's name
    op_kernel: Kernel | None = None

    def bind_op(self, name: str, kernel: Kernel) -> None:
        self.op_impl, self.op_kernel = name, kernel


def bind_layer_ops(model: nn.Module, registry: OpRegistry) -> Counter[str]:
    """Bind each op layer of `model` to its implementation; returns how many
    layers each implementation took ("torch" for the reference). A layer
    already bound (one a drafter shares with its target) keeps its kernel."""
    bound: Counter[str] = Counter()
    with torch.no_grad():  # a build may repack weights
        for module in model.modules():
            if isinstance(module, OpLayer):
                impl = None if module.op_kernel is not None else registry.select(module.op_name, module)
                if impl is not None:
                    module.bind_op(impl.name, impl.build(module))
                bound[module.op_impl] += 1
    logger.info("layer ops: %s", ", ".join(f"{name} x{count}" for name, count in sorted(bound.items())) or "none")
    return bound
