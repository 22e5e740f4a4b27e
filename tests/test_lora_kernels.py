"""The "lora" op's kernels (platforms/cpu/lora.py and its C kernel,
platforms/cuda_lora.py in Triton) against `lora_reference` and a per-row
float64 loop: rows of different adapters interleaved in ragged groups, rows
without an adapter, an adapter of a smaller rank than its slot (a partly
zero rank block), stacked sub-matrices whose rows straddle the kernels'
blocks; the C kernel inside a CPU graph replayed after the slots changed;
the op registry's binding. The Triton kernels run in the interpreter
(TRITON_INTERPRET=1, set by conftest) on host tensors, float32 and float16;
with PAGEDLLM_TEST_DEVICE=cuda and TRITON_INTERPRET=0 compiled on a GPU."""

from __future__ import annotations

import importlib.util
import os
from typing import Any, NamedTuple

import pytest
import torch

from pagedllm.model_registry.layers.linear import ColumnParallelLinear
from pagedllm.model_registry.layers.lora import LoRABatchState, LoRASlots, lora_reference
from pagedllm.model_registry.layers.ops import LORA, OpRegistry, bind_layer_ops
from pagedllm.platforms.cpu import lora as cpu_lora
from pagedllm.platforms.cpu.graph import CpuGraph
from pagedllm.platforms.cpu.platform import CpuPlatform
from pagedllm.platforms.cuda import CudaPlatform, triton_lora_supports
from pagedllm.testing.attention_case import DEVICE

NUM_SLOTS = 4
# Slot 3's adapter has rank 3 of its slot's 8 (or 20): the rest of its block is zero.
SMALL_RANK_SLOT, SMALL_RANK = 3, 3
# Interleaved, ragged: slot 2 has the most rows, slot 4 comes in a run, 0 is the base model.
SLOT_PATTERN = [2, 0, 1, 2, 3, 0, 1, 4, 4, 4, 2, 0, 3, 2]


class Shape(NamedTuple):
    input_size: int
    output_sizes: list[int]
    max_rank: int


# q/k/v-like: three sub-matrices, the second 16-row block straddles two of
# them, rank 8 < one 16-lane vector; and one matrix of rank 20 (two rank
# chunks, the second partial) over an input that is not a multiple of 16.
SHAPES = {"stacked": Shape(40, [24, 8, 8], 8), "rank20": Shape(70, [50], 20)}
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=2e-2, rtol=2e-3),
             torch.bfloat16: dict(atol=0.25, rtol=1e-2)}


def make_layer(shape: Shape, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0) -> LoRASlots:
    layer = LoRASlots(LoRABatchState(), num_slots=NUM_SLOTS, max_rank=shape.max_rank,
                      input_size=shape.input_size, output_sizes=shape.output_sizes, dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    rank = shape.max_rank
    start = 0
    for slot in range(1, NUM_SLOTS + 1):
        used = SMALL_RANK if slot == SMALL_RANK_SLOT else rank
        start = 0
        for i, size in enumerate(shape.output_sizes):  # each sub-matrix its own rank block
            block = slice(i * rank, i * rank + used)
            layer.lora_a[slot, block] = torch.randn(used, shape.input_size, generator=generator)
            layer.lora_b[slot, start:start + size, block] = torch.randn(size, used, generator=generator) * 0.5
            start += size
    return layer.to(device=device, dtype=dtype)


def make_slots(num_rows: int, chunk: int = 0) -> torch.Tensor:
    """SLOT_PATTERN repeated; `chunk` more rows of slot 1 at the end (a prefill chunk)."""
    slots = [SLOT_PATTERN[t % len(SLOT_PATTERN)] for t in range(num_rows - chunk)] + [1] * chunk
    return torch.tensor(slots, dtype=torch.int32)


def make_rows(num_rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(num_rows, width, generator=torch.Generator().manual_seed(seed)).to(dtype)


def per_row_loop(y: torch.Tensor, x: torch.Tensor, layer: LoRASlots, slots: torch.Tensor) -> torch.Tensor:
    """y + each row's adapter product, one row at a time in float64."""
    out = y.double().clone()
    for t, slot in enumerate(slots.tolist()):
        if slot != 0:
            out[t] += (x[t].double() @ layer.lora_a[slot].double().T) @ layer.lora_b[slot].double().T
    return out


def check_against_both(out: torch.Tensor, y: torch.Tensor, x: torch.Tensor, layer: LoRASlots,
                       slots: torch.Tensor) -> None:
    expected = per_row_loop(y, x, layer, slots)
    torch.testing.assert_close(out.double(), expected, **TOLERANCE[out.dtype])
    reference = y.clone()
    lora_reference(reference, x, layer.lora_a, layer.lora_b, slots)
    torch.testing.assert_close(out, reference, **TOLERANCE[out.dtype])
    base_rows = slots == 0
    assert torch.equal(out[base_rows], y[base_rows])  # untouched, bit for bit
    assert not torch.allclose(out[~base_rows].double(), y[~base_rows].double(), atol=1e-2)  # and the others not


# -------------------------------------------------------------- the CPU kernel

needs_c_kernel = pytest.mark.skipif(cpu_lora.load() is None, reason="no C compiler or no AVX-512")
CPU_DTYPES = [torch.float32, torch.bfloat16]
# (rows, of which a trailing chunk of slot 1): the last one past GEMM_MIN_ROWS.
ROWS = [(1, 0), (7, 0), (33, 0), (cpu_lora.GEMM_MIN_ROWS + 16, cpu_lora.GEMM_MIN_ROWS + 2)]


@needs_c_kernel
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("num_rows,chunk", ROWS)
def test_cpu_c_kernel_equals_the_reference(num_rows: int, chunk: int, dtype: torch.dtype, shape: Shape) -> None:
    layer = make_layer(shape, dtype)
    x = make_rows(num_rows, shape.input_size, dtype, seed=1)
    y = make_rows(num_rows, sum(shape.output_sizes), dtype, seed=2)
    slots = make_slots(num_rows, chunk)
    out = y.clone()
    cpu_lora.CpuLoRAKernel(layer).c_kernel(cpu_lora.load(), out, x, slots)
    check_against_both(out, y, x, layer, slots)


@pytest.mark.parametrize("dtype", CPU_DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("num_rows,chunk", ROWS + [
    (cpu_lora.GEMM_MIN_ROWS + 4, 0),  # past the switch, no large group: all on the C kernel
    (cpu_lora.GEMM_MIN_ROWS + 4, cpu_lora.GEMM_MIN_ROWS + 4),  # one adapter only: all GEMMs
])
def test_cpu_op_equals_the_reference_on_every_path(num_rows: int, chunk: int, dtype: torch.dtype) -> None:
    # As bound: the C kernel below GEMM_MIN_ROWS rows; above, GEMMs for a slot
    # with that many rows and the C kernel for the other rows.
    layer = make_layer(SHAPES["stacked"], dtype, seed=3)
    x = make_rows(num_rows, 40, dtype, seed=4)
    y = make_rows(num_rows, 40, dtype, seed=5)
    slots = make_slots(num_rows, chunk)
    out = y.clone()
    cpu_lora.CpuLoRAKernel(layer)(out, x, slots)
    check_against_both(out, y, x, layer, slots)


def test_cpu_op_without_the_library_groups_in_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_lora, "load", lambda: None)
    layer = make_layer(SHAPES["stacked"], torch.float32, seed=6)
    x, y, slots = make_rows(33, 40, torch.float32, seed=7), make_rows(33, 40, torch.float32, seed=8), make_slots(33)
    out = y.clone()
    cpu_lora.CpuLoRAKernel(layer)(out, x, slots)
    check_against_both(out, y, x, layer, slots)


def test_cpu_op_refuses_slots_that_do_not_match_the_rows() -> None:
    layer = make_layer(SHAPES["stacked"], torch.float32)
    x, y = make_rows(7, 40, torch.float32, seed=1), make_rows(7, 40, torch.float32, seed=2)
    with pytest.raises(ValueError, match="slots"):
        cpu_lora.CpuLoRAKernel(layer)(y, x, make_slots(5))


def capture_and_replay_with_new_slots(add: Any, layer: LoRASlots, num_rows: int, chunk: int) -> None:
    """Capture `add(y, x, slots)` on one batch, write other rows and slots
    into the same tensors, replay: the new batch's result."""
    x = make_rows(num_rows, 40, torch.float32, seed=9)
    y0 = make_rows(num_rows, 40, torch.float32, seed=10)
    slots = make_slots(num_rows, chunk)

    def forward() -> torch.Tensor:
        y = y0.clone()
        add(y, x, slots)
        return y

    with torch.inference_mode():
        graph = CpuGraph.capture(forward)
    assert graph.output is not None
    check_against_both(graph.output, y0, x, layer, slots)
    new_slots = slots.flip(0).roll(3)
    new_slots[new_slots == 4] = 0  # slot 4 drops out, other rows join
    slots.copy_(new_slots)
    x.copy_(make_rows(num_rows, 40, torch.float32, seed=11))
    with torch.inference_mode():
        graph.replay()
    check_against_both(graph.output, y0, x, layer, new_slots)


@needs_c_kernel
def test_cpu_c_kernel_in_a_graph_follows_the_slots_written_before_a_replay() -> None:
    # Past GEMM_MIN_ROWS, where an eager call would read the slots on the host:
    # under capture the C kernel takes every row.
    layer = make_layer(SHAPES["stacked"], torch.float32, seed=12)
    kernel = cpu_lora.CpuLoRAKernel(layer)
    capture_and_replay_with_new_slots(kernel, layer, cpu_lora.GEMM_MIN_ROWS + 16, cpu_lora.GEMM_MIN_ROWS + 2)


def test_cpu_op_without_the_library_captures_its_masked_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_lora, "load", lambda: None)
    layer = make_layer(SHAPES["stacked"], torch.float32, seed=13)
    capture_and_replay_with_new_slots(cpu_lora.CpuLoRAKernel(layer), layer, 20, 0)


def test_the_reference_captured_in_a_graph_equals_its_eager_form() -> None:
    layer = make_layer(SHAPES["stacked"], torch.float32, seed=14)

    def reference(y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
        lora_reference(y, x, layer.lora_a, layer.lora_b, slots)

    capture_and_replay_with_new_slots(reference, layer, 20, 0)  # the masked path, checked against the loop
    x, y, slots = make_rows(20, 40, torch.float32, seed=15), make_rows(20, 40, torch.float32, seed=16), make_slots(20)
    eager = y.clone()
    reference(eager, x, slots)

    def forward() -> torch.Tensor:
        out = y.clone()
        reference(out, x, slots)
        return out

    with torch.inference_mode():
        captured = CpuGraph.capture(forward)
    assert captured.output is not None
    torch.testing.assert_close(captured.output, eager, atol=1e-5, rtol=1e-6)


@needs_c_kernel
def test_a_captured_forward_of_adapted_linear_layers_follows_the_step_slots() -> None:
    # Two linear layers sharing one LoRABatchState, bound on the CPU platform
    # (prepacked GEMMs and the LoRA kernel), captured as a decode graph with a
    # persistent slots buffer; the runner then writes a new step into it.
    state = LoRABatchState()
    model = torch.nn.Sequential(ColumnParallelLinear(40, 40), ColumnParallelLinear(40, 40))
    for seed, linear in enumerate(model):
        slots_layer = make_layer(SHAPES["stacked"], torch.float32, seed=30 + seed)
        slots_layer.state = state
        linear.lora_slots = slots_layer
        linear.weight.data = make_rows(40, 40, torch.float32, seed=40 + seed) / 8
    registry = OpRegistry()
    CpuPlatform().register_layer_ops(registry.register)
    assert bind_layer_ops(model, registry)[cpu_lora.IMPL_NAME] == 2
    x, state.token_slots = make_rows(9, 40, torch.float32, seed=50), make_slots(9)

    def expected() -> torch.Tensor:
        h = x.double()
        for linear in model:
            h = per_row_loop(h @ linear.weight.double().T, h, linear.lora_slots, state.token_slots)
        return h

    with torch.inference_mode():
        graph = CpuGraph.capture(lambda: model(x))
    assert graph.output is not None
    torch.testing.assert_close(graph.output.double(), expected(), atol=1e-3, rtol=1e-5)
    state.token_slots.copy_(make_slots(9).roll(4))
    x.copy_(make_rows(9, 40, torch.float32, seed=51))
    with torch.inference_mode():
        graph.replay()
    torch.testing.assert_close(graph.output.double(), expected(), atol=1e-3, rtol=1e-5)


# -------------------------------------------------------------- the op registry


def test_the_cpu_platform_binds_its_kernel_to_float32_and_bfloat16_slots() -> None:
    registry = OpRegistry()
    CpuPlatform().register_layer_ops(registry.register)
    for dtype in CPU_DTYPES:
        layer = make_layer(SHAPES["stacked"], dtype, seed=17)
        assert bind_layer_ops(layer, registry) == {cpu_lora.IMPL_NAME: 1}
        x, y, slots = make_rows(7, 40, dtype, seed=18), make_rows(7, 40, dtype, seed=19), make_slots(7)
        layer.state.token_slots = slots
        out = y.clone()
        layer.add_lora(out, x)
        check_against_both(out, y, x, layer, slots)
    assert bind_layer_ops(make_layer(SHAPES["stacked"], torch.float16), registry) == {"torch": 1}


def test_a_platform_without_a_lora_kernel_leaves_the_reference() -> None:
    layer = make_layer(SHAPES["stacked"], torch.float32, seed=20)
    assert bind_layer_ops(layer, OpRegistry()) == {"torch": 1}
    x, y, slots = make_rows(7, 40, torch.float32, seed=21), make_rows(7, 40, torch.float32, seed=22), make_slots(7)
    out = y.clone()
    layer.add_lora(out, x)  # no slots set this step: nothing added
    assert torch.equal(out, y)
    layer.state.token_slots = slots
    layer.add_lora(out, x)
    check_against_both(out, y, x, layer, slots)


# -------------------------------------------------------------- the Triton kernels

needs_triton = pytest.mark.skipif(
    (os.environ.get("TRITON_INTERPRET") != "1" and DEVICE.type != "cuda") or importlib.util.find_spec("triton") is None,
    reason="needs triton and its interpreter or a CUDA device",
)
TRITON_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])


def run_triton(form: str, layer: LoRASlots, y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor) -> None:
    from pagedllm.platforms import cuda_lora

    if form == "rows":
        sub_of_row = cuda_lora.sub_matrix_of_rows(layer.output_sizes, y.device)
        cuda_lora.lora_shrink_expand(y, x, slots, layer.lora_a, layer.lora_b, sub_of_row, layer.max_rank)
    elif form == "segments":
        cuda_lora.lora_shrink_expand_segments(y, x, slots, layer.lora_a, layer.lora_b)
    else:  # as bound: by the number of rows
        cuda_lora.build(layer)(y, x, slots)


@needs_triton
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
@pytest.mark.parametrize("dtype", TRITON_DTYPES, ids=lambda dtype: str(dtype).removeprefix("torch."))
@pytest.mark.parametrize("num_rows,chunk,form", [
    (1, 0, "rows"), (7, 0, "rows"), (33, 0, "rows"), (1, 0, "segments"), (7, 0, "segments"), (33, 0, "segments"),
    (70, 40, "built"),  # past SEGMENT_MIN_ROWS: segments, a slot with three row tiles
])
def test_triton_kernels_equal_the_reference(num_rows: int, chunk: int, form: str, dtype: torch.dtype,
                                            shape: Shape) -> None:
    layer = make_layer(shape, dtype, device=DEVICE)
    x = make_rows(num_rows, shape.input_size, dtype, seed=23).to(DEVICE)
    y = make_rows(num_rows, sum(shape.output_sizes), dtype, seed=24).to(DEVICE)
    slots = make_slots(num_rows, chunk).to(DEVICE)
    out = y.clone()
    run_triton(form, layer, out, x, slots)
    host = make_layer(shape, torch.float32)  # the loop's weights: the same values, in float32 on the host
    host.lora_a.copy_(layer.lora_a.float().cpu())
    host.lora_b.copy_(layer.lora_b.float().cpu())
    expected = per_row_loop(y.cpu(), x.cpu(), host, slots.cpu())
    torch.testing.assert_close(out.cpu().double(), expected, **TOLERANCE[dtype])
    base_rows = slots.cpu() == 0
    assert torch.equal(out.cpu()[base_rows], y.cpu()[base_rows])
    if dtype == torch.float32:
        reference = y.clone()
        lora_reference(reference, x, layer.lora_a, layer.lora_b, slots)
        torch.testing.assert_close(out, reference, **TOLERANCE[dtype])


@needs_triton
def test_triton_rows_are_grouped_by_slot_on_the_device() -> None:
    from pagedllm.platforms import cuda_lora

    sorted_rows, counts, starts = cuda_lora.group_rows_by_slot(torch.tensor([2, 0, 1, 2, 4, 0, 2]).to(DEVICE), 5)
    assert sorted_rows.tolist() == [1, 5, 2, 0, 3, 6, 4]  # stable: each slot's rows in order
    assert counts.tolist() == [2, 1, 3, 0, 1]
    assert starts.tolist() == [0, 2, 3, 6, 6]


_real_find_spec = importlib.util.find_spec


def test_the_cuda_platform_registers_the_triton_kernel_for_cuda_slots_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))

    def find_spec(name: str, package: str | None = None) -> Any:
        return object() if name == "triton" else _real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    registry = OpRegistry()
    CudaPlatform().register_layer_ops(registry.register)
    (impl,) = registry.implementations(LORA)
    assert impl.name == "triton_lora"
    layer = make_layer(SHAPES["stacked"], torch.float16)
    assert not triton_lora_supports(layer)  # host buffers: the reference runs
    assert bind_layer_ops(layer, registry) == {"torch": 1}
    for name in ("lora_a", "lora_b"):
        setattr(layer, name, torch.Tensor._make_subclass(_CudaLooking, getattr(layer, name)))
    assert impl.supports(layer) and registry.select(LORA, layer) is impl
    layer.lora_b = layer.lora_b.to(torch.float32)  # buffers of two dtypes are not ours
    assert not triton_lora_supports(layer)


class _CudaLooking(torch.Tensor):
    """A host tensor that says it is on a CUDA device (there is none here)."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True
