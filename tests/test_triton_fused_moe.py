"""The CUDA platform's Triton fused-MoE kernel (platforms/cuda_fused_moe.py)
against `FusedMoE.forward_reference`, on CPU through the Triton interpreter
(TRITON_INTERPRET=1, set by conftest before any kernel is defined); with
PAGEDLLM_TEST_DEVICE=cuda and TRITON_INTERPRET=0 the same cases run compiled
on a GPU. Shapes stay small: the interpreter runs every program in Python.
bfloat16 is compared on a GPU only: the interpreter's bfloat16 `tl.dot` is wrong."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
import torch

from pagedllm.model_registry.layers.fused_moe import FusedMoE
from pagedllm.model_registry.layers.moe_router import RouterConfig
from pagedllm.model_registry.layers.ops import FUSED_MOE, OpRegistry, bind_layer_ops
from pagedllm.platforms.cuda import CudaPlatform, triton_fused_moe_supports
from pagedllm.testing.attention_case import DEVICE

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and DEVICE.type != "cuda",
    reason="needs the Triton interpreter or a CUDA device",
)

cuda_fused_moe = pytest.importorskip("pagedllm.platforms.cuda_fused_moe")

NUM_EXPERTS = 6
# Experts 1 and 4 never get a token; the others get ragged loads.
USED_EXPERTS = (0, 2, 3, 5)
EXPERT_POPULARITY = torch.tensor([5.0, 0.0, 1.0, 3.0, 0.0, 0.5])
# Neither a multiple of the 64-wide column tiles nor of the 64-deep K steps: the masks matter.
HIDDEN, INTERMEDIATE = 40, 24
# Small enough that the swigluoai clamps cut real values.
SWIGLU_LIMIT = 0.75
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def make_layer(activation: str, bias: bool, top_k: int, dtype: torch.dtype, seed: int = 0) -> FusedMoE:
    generator = torch.Generator().manual_seed(seed)
    layer = FusedMoE(RouterConfig(NUM_EXPERTS, top_k), HIDDEN, INTERMEDIATE, bias=bias, activation=activation,
                     swiglu_limit=SWIGLU_LIMIT if activation == "swigluoai" else None)
    for param in layer.parameters():
        param.data = torch.randn(param.shape, generator=generator) / param.shape[-1] ** 0.5
        if param.dim() == 2:  # a bias: about the size of a row's product
            param.data *= param.shape[-1] ** 0.5 * 0.3
    return layer.to(device=DEVICE, dtype=dtype)


def make_routing(num_tokens: int, top_k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct experts per token, drawn by popularity (ragged loads, two empty experts)."""
    generator = torch.Generator().manual_seed(seed)
    topk_ids = torch.stack([
        torch.multinomial(EXPERT_POPULARITY, top_k, replacement=False, generator=generator)
        for _ in range(num_tokens)
    ])
    topk_weights = torch.rand(num_tokens, top_k, generator=generator).softmax(dim=-1)
    return topk_weights.to(DEVICE), topk_ids.to(DEVICE)


def make_input(num_tokens: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed + 1)
    return torch.randn(num_tokens, HIDDEN, generator=generator).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("activation", ["silu", "swigluoai"])
@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (1, 4), (7, 2), (7, 3), (33, 1), (33, 4)])
def test_kernel_equals_the_reference(num_tokens: int, top_k: int, activation: str, bias: bool,
                                     dtype: torch.dtype) -> None:
    layer = make_layer(activation, bias, top_k, dtype)
    topk_weights, topk_ids = make_routing(num_tokens, top_k)
    x = make_input(num_tokens, dtype)
    loads = torch.bincount(topk_ids.flatten().cpu(), minlength=NUM_EXPERTS)
    assert loads[[1, 4]].tolist() == [0, 0]

    out = cuda_fused_moe.build(layer)(x, topk_weights, topk_ids)

    expected = layer.forward_reference(x, topk_weights, topk_ids)
    assert out.dtype == dtype and out.shape == (num_tokens, HIDDEN)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("block_m", [16, 32, 64])
def test_every_block_size_gives_the_same_sums(block_m: int) -> None:
    # 33 tokens x 3: segments of ~50, ~30, ~15 and ~5 pairs: every block size
    # leaves partly padded blocks, and 64 puts a whole expert in one.
    layer = make_layer("silu", True, 3, torch.float32)
    topk_weights, topk_ids = make_routing(33, 3)
    x = make_input(33, torch.float32)
    config = cuda_fused_moe.MoeConfig(block_m, 32, 16, 2, 4, 2)

    out = cuda_fused_moe.fused_experts(
        x, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids, w13_bias=layer.w13_bias,
        w2_bias=layer.w2_bias, config=config,
    )

    torch.testing.assert_close(out, layer.forward_reference(x, topk_weights, topk_ids), **TOLERANCE[torch.float32])


def test_the_clamp_and_alpha_of_swigluoai_matter() -> None:
    # A kernel that ignored the limit or alpha would still be close to the
    # reference of some other setting: check it is far from those.
    layer = make_layer("swigluoai", False, 2, torch.float32)
    topk_weights, topk_ids = make_routing(7, 2)
    x = make_input(7, torch.float32) * 4
    out = cuda_fused_moe.build(layer)(x, topk_weights, topk_ids)
    torch.testing.assert_close(out, layer.forward_reference(x, topk_weights, topk_ids), **TOLERANCE[torch.float32])
    for attribute, other in (("swiglu_limit", float("inf")), ("swiglu_alpha", 1.0)):
        original = getattr(layer, attribute)
        setattr(layer, attribute, other)
        assert not torch.allclose(out, layer.forward_reference(x, topk_weights, topk_ids), atol=1e-3)
        setattr(layer, attribute, original)


def test_no_tokens_gives_an_empty_output() -> None:
    layer = make_layer("silu", False, 2, torch.float32)
    empty_ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    out = cuda_fused_moe.build(layer)(make_input(0, torch.float32), torch.zeros(0, 2, device=DEVICE), empty_ids)
    assert out.shape == (0, HIDDEN)


# ------------------------------------------------------------- the align step


def test_align_sorts_pairs_into_padded_expert_blocks() -> None:
    # Pairs (token * 2 + j): 0->e2, 1->e0, 2->e2, 3->e3, 4->e0, 5->e2; expert 1 has none.
    topk_ids = torch.tensor([[2, 0], [2, 3], [0, 2]], device=DEVICE)
    aligned = cuda_fused_moe.moe_align_block_size(topk_ids, block_m=4, num_experts=4)
    pad = 6  # the sentinel: the number of pairs
    assert aligned.sorted_token_ids.tolist() == [
        1, 4, pad, pad,  # expert 0
        0, 2, 5, pad,  # expert 2 (expert 1 has no block)
        3, pad, pad, pad,  # expert 3
        pad, pad, pad, pad, pad, pad, pad, pad,  # room for the worst case, unused
    ]
    assert aligned.expert_ids.tolist() == [0, 2, 3, -1, -1]
    assert aligned.num_tokens_post_padded.tolist() == [12]
    assert aligned.sorted_token_ids.dtype == aligned.expert_ids.dtype == torch.int32


def test_align_pads_a_full_segment_only_when_it_overflows() -> None:
    # Expert 1 gets exactly one block of 4; expert 0 five pairs: two blocks.
    topk_ids = torch.tensor([[1], [0], [1], [0], [0], [1], [0], [1], [0]], device=DEVICE)
    aligned = cuda_fused_moe.moe_align_block_size(topk_ids, block_m=4, num_experts=3)
    total = aligned.num_tokens_post_padded.item()
    assert total == 12
    assert aligned.sorted_token_ids[:total].tolist() == [1, 3, 4, 6, 8, 9, 9, 9, 0, 2, 5, 7]
    assert aligned.expert_ids[: total // 4].tolist() == [0, 0, 1]
    assert set(aligned.expert_ids[total // 4:].tolist()) <= {-1}


# ------------------------------------------------------------ the registration

_real_find_spec = importlib.util.find_spec


def simulate_cuda(monkeypatch: pytest.MonkeyPatch, triton_installed: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def find_spec(name: str, package: str | None = None) -> Any:
        if name == "triton":
            return object() if triton_installed else None
        return _real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


class _CudaLooking(torch.Tensor):
    """A host tensor that says it is on a CUDA device (there is none here)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_cuda_platform_registers_the_kernel_for_cuda_layers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, triton_installed=True)
    registry = OpRegistry()
    CudaPlatform().register_layer_ops(registry.register)
    (impl,) = registry.implementations(FUSED_MOE)
    assert impl.name == "triton_fused_moe"

    layer = make_layer("silu", True, 2, torch.float16, seed=3).cpu()
    assert not impl.supports(layer)  # host weights: the reference runs
    assert bind_layer_ops(layer, registry) == {"torch": 1}
    on_cuda = torch.Tensor._make_subclass(_CudaLooking, layer.w13_weight.data)
    layer.w13_weight = torch.nn.Parameter(on_cuda, requires_grad=False)
    assert impl.supports(layer)
    assert registry.select(FUSED_MOE, layer) is impl
    layer.w13_weight.data = layer.w13_weight.data.to(torch.int8)  # a quantized layer is not ours
    assert not triton_fused_moe_supports(layer)


def test_the_registered_build_runs_the_triton_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, triton_installed=True)
    registry = OpRegistry()
    CudaPlatform().register_layer_ops(registry.register)
    (impl,) = registry.implementations(FUSED_MOE)
    layer = make_layer("swigluoai", True, 2, torch.float32, seed=4)
    topk_weights, topk_ids = make_routing(5, 2, seed=4)
    x = make_input(5, torch.float32, seed=4)
    layer.bind_op(impl.name, impl.build(layer))
    calls: list[int] = []
    real_launch = cuda_fused_moe._launch
    monkeypatch.setattr(cuda_fused_moe, "_launch", lambda *a, **k: (calls.append(1), real_launch(*a, **k))[1])

    out = layer.apply_experts(x, topk_weights, topk_ids)

    assert len(calls) == 2  # the two grouped GEMMs, not the reference
    torch.testing.assert_close(out, layer.forward_reference(x, topk_weights, topk_ids), **TOLERANCE[torch.float32])


def test_cuda_platform_without_triton_keeps_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, triton_installed=False)
    registry = OpRegistry()
    CudaPlatform().register_layer_ops(registry.register)
    assert registry.implementations(FUSED_MOE) == []


@pytest.mark.skipif(DEVICE.type != "cuda", reason="needs a CUDA device")
def test_kernel_replays_in_a_cuda_graph_with_new_routing() -> None:
    # Nothing reads a device value on the host: capture once, replay with other experts.
    layer = make_layer("silu", True, 2, torch.float16)
    kernel = cuda_fused_moe.build(layer)
    x = make_input(9, torch.float16)
    topk_weights, topk_ids = make_routing(9, 2)
    static_weights, static_ids = topk_weights.clone(), topk_ids.clone()
    kernel(x, static_weights, static_ids)  # compile outside the graph
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernel(x, static_weights, static_ids)
    new_weights, new_ids = make_routing(9, 2, seed=7)
    static_weights.copy_(new_weights)
    static_ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, layer.forward_reference(x, new_weights, new_ids), **TOLERANCE[torch.float16])
