"""A model's LoRA slots: every attention and MLP projection, by checkpoint name.

`attach_lora_slots` gives each linear layer of a loaded model a `LoRASlots`
(model_registry/layers/lora.py), all sharing one `LoRABatchState`, and
maps each checkpoint module an adapter may name to its place: a stacked
layer (the model's `packed_modules_mapping`: q_proj, k_proj, v_proj ->
qkv_proj) gives each of its checkpoint modules its own sub-block; a layer
the checkpoint holds fused (Phi-3's qkv_proj, gate_up_proj, which the
mapping does not split) is one module of one block, its B's rows split as
the weight's are. The LM head, embeddings, MoE experts and routers get no
slots (nor any layer that other code reads as a raw matrix:
`skip_quantization`).

Every rank attaches the same slots to its shard of each layer and copies
its shard of each adapter (lora/targets.py) when the scheduler puts an
adapter in a slot (`load_slot`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
from torch import nn

from pagedllm.lora.adapter import LoRAAdapterError
from pagedllm.lora.targets import LoRATarget, full_columns, full_rows, stacked_output_sizes
from pagedllm.model_registry.layers.linear import LinearBase, MergedColumnParallelLinear, QKVParallelLinear
from pagedllm.model_registry.layers.lora import LoRABatchState, LoRASlots
from pagedllm.model_registry.layers.vocab_parallel_embedding import ParallelLMHead

logger = logging.getLogger(__name__)


class LoRAModelSlots:
    """The adapter slots of one model on this rank."""

    def __init__(self, state: LoRABatchState, targets: dict[str, LoRATarget], *, max_loras: int,
                 max_rank: int) -> None:
        self.state = state
        self.targets = targets  # checkpoint module name -> its place
        self.max_loras = max_loras
        self.max_rank = max_rank
        self.layers = list({id(target.slots): target.slots for target in targets.values()}.values())

    def supported_modules(self) -> dict[str, tuple[int, int]]:
        """Each checkpoint module an adapter may adapt, with its full (out, in)."""
        return {name: target.full_shape for name, target in self.targets.items()}

    def clear_slot(self, slot: int) -> None:
        self._check_slot(slot)
        for slots in self.layers:
            slots.lora_a[slot].zero_()
            slots.lora_b[slot].zero_()

    def load_slot(self, slot: int, weights: Mapping[str, torch.Tensor]) -> None:
        """Slot `slot` holds this adapter from now on: "<module>.lora_A"
        [r, in] and "<module>.lora_B" [out, r] (scaled) per module."""
        self.clear_slot(slot)
        for module in sorted(name.removesuffix(".lora_A") for name in weights if name.endswith(".lora_A")):
            target = self.targets.get(module)
            if target is None:
                raise LoRAAdapterError("target_modules", module,
                                       "a linear projection of the base model's attention or MLP blocks")
            lora_a, lora_b = weights[f"{module}.lora_A"], weights[f"{module}.lora_B"]
            self._check_shapes(module, target, lora_a, lora_b)
            target.load(slot, lora_a, lora_b)

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} outside 1..{self.max_loras}")

    def _check_shapes(self, module: str, target: LoRATarget, lora_a: torch.Tensor, lora_b: torch.Tensor) -> None:
        rank = lora_a.shape[0]
        if rank > self.max_rank:
            raise LoRAAdapterError("r", rank, f"module {module}: at most max_lora_rank={self.max_rank}")
        out_size, in_size = target.full_shape
        if tuple(lora_a.shape) != (rank, in_size) or tuple(lora_b.shape) != (out_size, rank):
            raise LoRAAdapterError(
                "weights", module, f"lora_A [{rank}, {in_size}] and lora_B [{out_size}, {rank}]: this model's "
                f"{module} is [out={out_size}, in={in_size}], the adapter's lora_A {tuple(lora_a.shape)} and "
                f"lora_B {tuple(lora_b.shape)}",
            )


def attach_lora_slots(
    model: nn.Module, *, max_loras: int, max_rank: int, dtype: torch.dtype, device: torch.device | str
) -> LoRAModelSlots:
    """Give every adaptable linear layer of `model` slots for `max_loras`
    adapters of rank <= `max_rank` (before the layer ops are bound)."""
    state = LoRABatchState()
    stacked = _stacked_modules(getattr(model, "packed_modules_mapping", {}))
    targets: dict[str, LoRATarget] = {}
    for prefix, layer in _adaptable_layers(model):
        parent, _, leaf = prefix.rpartition(".")
        sources = stacked.get(leaf)
        output_sizes = stacked_output_sizes(layer) if sources else [layer.out_features]
        slots = LoRASlots(state, num_slots=max_loras, max_rank=max_rank, input_size=layer.in_features,
                          output_sizes=output_sizes, dtype=dtype, device=device)
        layer.lora_slots = slots
        layer.add_module("lora", slots)
        for name, target in _layer_targets(layer, slots, parent, leaf, sources):
            targets[name] = target
    logger.info("LoRA: %d modules of %d layers adaptable, %d slots of rank %d",
                len(targets), len({id(t.slots) for t in targets.values()}), max_loras, max_rank)
    return LoRAModelSlots(state, targets, max_loras=max_loras, max_rank=max_rank)


def _layer_targets(layer: LinearBase, slots: LoRASlots, parent: str, leaf: str,
                   sources: tuple[str, ...] | None) -> list[tuple[str, LoRATarget]]:
    """The checkpoint modules `layer` holds, each with its place."""
    in_size = full_columns(layer)
    if sources:  # stacked: one sub-block per checkpoint module
        return [
            (_join(parent, source), LoRATarget(layer, slots, sub, sub, None, (full_rows(layer, sub), in_size)))
            for sub, source in enumerate(sources)
        ]
    fused_sizes = None
    if isinstance(layer, QKVParallelLinear | MergedColumnParallelLinear):  # the checkpoint holds it fused
        fused_sizes = tuple(full_rows(layer, shard_id) for shard_id in range(len(stacked_output_sizes(layer))))
    return [(_join(parent, leaf), LoRATarget(layer, slots, 0, None, fused_sizes, (full_rows(layer, None), in_size)))]


def _adaptable_layers(model: nn.Module) -> list[tuple[str, LinearBase]]:
    """The projections: linear layers but the LM head and those read raw (routers, absorbed matrices)."""
    return [
        (prefix, module) for prefix, module in model.named_modules()
        if isinstance(module, LinearBase) and not isinstance(module, ParallelLMHead) and not module.skip_quantization
    ]


def _stacked_modules(packed: Mapping[str, tuple[str, int]]) -> dict[str, tuple[str, ...]]:
    """packed_modules_mapping inverted: stacked layer -> its checkpoint modules in shard order."""
    stacked: dict[str, list[tuple[int, str]]] = {}
    for source, (target, shard_id) in packed.items():
        stacked.setdefault(target, []).append((shard_id, source))
    return {target: tuple(source for _, source in sorted(sources)) for target, sources in stacked.items()}


def _join(parent: str, leaf: str) -> str:
    return f"{parent}.{leaf}" if parent else leaf
