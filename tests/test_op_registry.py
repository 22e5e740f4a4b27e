"""The op registry (model_registry/layers/ops.py): one way to swap a layer's
compute. A layer asks once, when the model is prepared, and keeps the answer;
nothing patches a built module or swaps a global at run time."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedllm.model_registry.layers import op_kernels
from pagedllm.model_registry.layers.activation import SiluAndMul
from pagedllm.model_registry.layers.linear import ColumnParallelLinear
from pagedllm.model_registry.layers.ops import LINEAR, SILU_AND_MUL, OpLayer, OpRegistry, bind_layer_ops

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def _kernel(tag: float) -> Callable[[torch.nn.Module], Callable[..., torch.Tensor]]:
    return lambda layer: (lambda x, bias: torch.full((x.shape[0], layer.weight.shape[0]), tag))


def test_the_highest_priority_that_supports_the_layer_wins() -> None:
    registry = OpRegistry()
    registry.register(LINEAR, "low", _kernel(1.0), priority=1)
    registry.register(LINEAR, "high_bf16_only", _kernel(3.0), priority=9,
                      supports=lambda layer: layer.weight.dtype == torch.bfloat16)
    registry.register(LINEAR, "mid", _kernel(2.0), priority=5)
    registry.register(LINEAR, "mid_later", _kernel(4.0), priority=5)  # a tie: the first registered wins
    float_layer, bf16_layer = ColumnParallelLinear(4, 2), ColumnParallelLinear(4, 2).to(torch.bfloat16)
    assert [impl.name for impl in registry.implementations(LINEAR)] == ["high_bf16_only", "mid", "mid_later", "low"]
    assert bind_layer_ops(torch.nn.ModuleList([float_layer, bf16_layer]), registry) == {"mid": 1,
                                                                                        "high_bf16_only": 1}
    assert float_layer(torch.ones(3, 4)).tolist() == [[2.0, 2.0]] * 3
    assert bf16_layer(torch.ones(3, 4)).tolist() == [[3.0, 3.0]] * 3


def test_a_layer_no_implementation_supports_runs_its_torch_reference() -> None:
    registry = OpRegistry()
    registry.register(LINEAR, "never", _kernel(1.0), supports=lambda layer: False)
    layer = ColumnParallelLinear(4, 2, bias=True)
    assert bind_layer_ops(layer, registry) == {"torch": 1}
    x = torch.randn(3, 4)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))


def test_a_layer_asks_once_and_keeps_its_kernel() -> None:
    registry = OpRegistry()
    registry.register(SILU_AND_MUL, "first", lambda layer: lambda gate_up: torch.zeros(1))
    layer = SiluAndMul()
    bind_layer_ops(layer, registry)
    later = OpRegistry()
    later.register(SILU_AND_MUL, "later", lambda layer: lambda gate_up: torch.ones(1), priority=100)
    registry.register(SILU_AND_MUL, "late", lambda layer: lambda gate_up: torch.ones(1), priority=100)
    assert bind_layer_ops(layer, later) == {"first": 1}  # a layer shared with a drafter keeps its kernel
    assert layer.op_impl == "first" and layer(torch.ones(2, 4)).tolist() == [0.0]


def test_an_implementation_name_is_registered_once_per_op() -> None:
    registry = OpRegistry()
    registry.register(LINEAR, "mine", _kernel(1.0))
    with pytest.raises(ValueError, match="op 'linear' already has an implementation named 'mine'"):
        registry.register(LINEAR, "mine", _kernel(2.0))
    with pytest.raises(ValueError, match="already has an implementation named 'torch'"):
        registry.register(SILU_AND_MUL, "torch", lambda layer: lambda x: x)


def test_the_deprecated_process_wide_kernel_is_offered_below_every_registered_one() -> None:
    def legacy(gate_up: torch.Tensor) -> torch.Tensor:
        return torch.full((1,), 7.0)

    with pytest.warns(DeprecationWarning, match="register_layer_ops"):
        op_kernels.register_op_kernel(op_kernels.SILU_AND_MUL, legacy)
    try:
        alone, beaten = SiluAndMul(), SiluAndMul()
        assert bind_layer_ops(alone, OpRegistry()) == {"legacy": 1}
        registry = OpRegistry()
        registry.register(SILU_AND_MUL, "platform", lambda layer: lambda gate_up: None)
        assert bind_layer_ops(beaten, registry) == {"platform": 1}
    finally:
        op_kernels.unregister_op_kernels()
    assert alone(torch.ones(2, 4)).tolist() == [7.0]  # bound before the unregister: kept


# Modules allowed to assign a module's forward, and why.
FORWARD_ASSIGNERS = {
    # torch.compile wraps the whole model.forward (and keeps attention out of
    # the graph): a compiler's wrapper, not a choice of kernel.
    "worker/compile.py",
}


def _patching_assignments(source: str) -> list[str]:
    """`x.forward = ...` / `x.apply_linear = ...` outside a class body's own `self`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and target.attr in ("forward", "apply_linear"):
                found.append(f"line {node.lineno}: {ast.unparse(target)} = ...")
    return found


def test_the_checker_finds_a_planted_forward_patch() -> None:
    planted = "def prepare(module, gemm):\n    module.forward = gemm\n    layer.apply_linear = gemm\n"
    assert _patching_assignments(planted) == ["line 2: module.forward = ...", "line 3: layer.apply_linear = ..."]


def test_no_package_module_patches_a_built_modules_forward_or_gemm() -> None:
    offenders = {}
    for path in sorted(PACKAGE_ROOT.rglob("*.py")):
        relative = path.relative_to(PACKAGE_ROOT).as_posix()
        if relative.startswith(("tests/", "examples/", "benchmarks/", ".")) or relative in FORWARD_ASSIGNERS:
            continue
        found = _patching_assignments(path.read_text())
        if found:
            offenders[relative] = found
    assert offenders == {}


def _impls(model: torch.nn.Module) -> set[tuple[str, str]]:
    return {(type(layer).__name__, layer.op_impl) for layer in model.modules() if isinstance(layer, OpLayer)}


def test_a_worker_binds_the_target_and_its_draft_model_alike() -> None:
    from pagedllm import LLM

    llm = LLM("tiny", dtype="float32", num_kv_blocks=64, speculative_method="draft_model",
              speculative_model="tiny-draft", num_speculative_tokens=2)
    try:
        worker = llm.engine_core.engine_core.model_executor.driver_worker  # type: ignore[attr-defined]
        target, draft = _impls(worker.model), _impls(worker.drafter.model)
    finally:
        llm.shutdown()
    # The same implementations (the platform's kernels where they build here), the draft's included.
    assert draft == target and {name for name, _ in draft} >= {"RMSNorm", "SiluAndMul", "ApplyRotaryEmb"}


def test_an_eagle_heads_layers_run_the_targets_kernels_its_input_projection_too() -> None:
    from pagedllm import LLM

    llm = LLM("tiny", dtype="float32", num_kv_blocks=64, speculative_method="eagle",
              speculative_model="tiny-eagle", num_speculative_tokens=2)
    try:
        worker = llm.engine_core.engine_core.model_executor.driver_worker  # type: ignore[attr-defined]
        target, head = dict(_impls(worker.model)), _impls(worker.drafter.head)
    finally:
        llm.shutdown()
    # fc (2H -> H) is a ReplicatedLinear: the platform's GEMM, as the target's linears.
    assert ("ReplicatedLinear", target["QKVParallelLinear"]) in head
    assert head <= set(target.items()) | {("ReplicatedLinear", target["QKVParallelLinear"])}
