"""Grouped 8-bit and 4-bit weights: the canonical layout
(quantization/grouped_weight.py) and the CPU kernels that consume it
(platforms/cpu/grouped_linear.py), each path against reference_linear
(plain torch: the dequantized weight, F.linear in float32)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pagedllm.platforms.cpu import grouped_linear
from pagedllm.platforms.cpu.graph import CpuGraph
from pagedllm.quantization.grouped_weight import (
    GroupedWeight,
    GroupedWeightError,
    pack_w4,
    reference_linear,
    unpack_w4,
)

library = grouped_linear.load()
needs_decode_kernel = pytest.mark.skipif(library is None or not library.decode_kernel,
                                         reason="no C compiler or no AVX-512 for the decode kernel")
needs_library = pytest.mark.skipif(library is None, reason="no C compiler for the CPU kernels")

# K = 640: 8 rows of x pass over it in two chunks of 512 inputs (csrc/grouped_linear.c), a
# group of 128 across none, g = K across both. N = 40: not a multiple of the kernel's 16-row blocks.
NUM_OUT, NUM_IN = 40, 640


def random_weight(bits: int, group: int, with_offsets: bool, num_out: int = NUM_OUT,
                  num_in: int = NUM_IN, seed: int = 0) -> GroupedWeight:
    generator = torch.Generator().manual_seed(seed)
    groups = num_in // group
    scales = torch.rand(num_out, groups, generator=generator) * 0.02 + 0.001
    offsets = torch.randn(num_out, groups, generator=generator) * 0.05 if with_offsets else None
    if bits == 8:
        codes = torch.randint(-127, 128, (num_out, num_in), generator=generator).to(torch.int8)
    else:
        codes = pack_w4(torch.randint(0, 16, (num_out, num_in), generator=generator).to(torch.uint8))
    return GroupedWeight(bits, group, codes, scales, offsets)


def assert_matches_reference(out: torch.Tensor, reference: torch.Tensor, batched: bool) -> None:
    assert out.dtype == reference.dtype and out.shape == reference.shape
    scale = reference.float().abs().max().item()
    if reference.dtype == torch.float32:  # float32 sums in another order
        torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5 * scale)
    elif not batched:  # the same float32 sum rounded once: at most one bfloat16 step apart
        torch.testing.assert_close(out.float(), reference.float(), rtol=2 ** -7, atol=1e-6 * scale)
    else:  # each weight rounded to bfloat16 for the GEMM, as a bfloat16 checkpoint's are
        torch.testing.assert_close(out.float(), reference.float(), rtol=2e-2, atol=1e-2 * scale)


@pytest.fixture
def kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Names of the C functions the wrapper calls, in order."""
    calls: list[str] = []
    real = grouped_linear.kernel_call

    def spy(function: Any, *args: Any) -> Any:
        calls.append(function.__name__)
        return real(function, *args)

    monkeypatch.setattr(grouped_linear, "kernel_call", spy)
    return calls


def test_pack_w4_puts_even_inputs_in_the_low_nibble_and_unpack_inverts_it() -> None:
    codes = torch.tensor([[1, 2, 15, 0], [7, 9, 3, 12]], dtype=torch.uint8)
    packed = pack_w4(codes)
    assert packed.tolist() == [[0x21, 0x0F], [0x97, 0xC3]]
    assert torch.equal(unpack_w4(packed), codes)
    every_code = torch.randint(0, 16, (16, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(unpack_w4(pack_w4(every_code)), every_code)


def test_dequantize_applies_each_groups_scale_and_offset() -> None:
    codes = pack_w4(torch.tensor([[1, 2, 3, 4]], dtype=torch.uint8))
    weight = GroupedWeight(4, 2, codes, torch.tensor([[0.5, 2.0]]), torch.tensor([[-1.0, 0.25]]))
    assert weight.dequantize().tolist() == [[1 * 0.5 - 1, 2 * 0.5 - 1, 3 * 2.0 + 0.25, 4 * 2.0 + 0.25]]
    w8 = GroupedWeight(8, 4, torch.tensor([[-3, 0, 5, 127]], dtype=torch.int8), torch.tensor([[0.5]]), None)
    assert w8.dequantize(torch.bfloat16).tolist() == [[-1.5, 0.0, 2.5, 63.5]]


@pytest.mark.parametrize(("bits", "offsets", "tensor", "message"), [
    (4, None, None, "W4 needs offsets"),
    (8, None, "scales", r"scales must be float32 \[40, 20\]"),
    (8, None, "codes", "codes of W8 must be torch.int8"),
])
def test_a_weight_off_the_layout_is_refused_naming_the_tensor(bits: int, offsets: None, tensor: str | None,
                                                             message: str) -> None:
    weight = random_weight(bits, 32, with_offsets=True)._replace(offsets=offsets)
    if tensor == "scales":
        weight = weight._replace(scales=weight.scales[:, :-1])
    elif tensor == "codes":
        weight = weight._replace(codes=weight.codes.to(torch.int16))
    with pytest.raises(GroupedWeightError, match=message):
        grouped_linear.prepack(weight)


CASES = [(8, 16, True), (8, 32, False), (8, 128, True), (8, NUM_IN, False),
         (4, 16, True), (4, 32, True), (4, 64, True), (4, 128, True), (4, NUM_IN, True)]


@needs_decode_kernel
@pytest.mark.parametrize(("bits", "group", "with_offsets"), CASES, ids=[f"W{b}-g{g}-{'off' if o else 'nooff'}"
                                                                        for b, g, o in CASES])
def test_each_path_computes_the_reference(bits: int, group: int, with_offsets: bool,
                                          kernel_calls: list[str]) -> None:
    weight = random_weight(bits, group, with_offsets)
    kernel = grouped_linear.GroupedLinearKernel(weight)
    generator = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        bias = torch.randn(NUM_OUT, generator=generator).to(dtype)
        for num_rows in (1, 3, grouped_linear.DECODE_MAX_ROWS, 16, 40):
            x = torch.randn(num_rows, NUM_IN, generator=generator).to(dtype)
            for layer_bias in (None, bias):
                kernel_calls.clear()
                out = kernel(x, layer_bias)
                batched = num_rows > grouped_linear.DECODE_MAX_ROWS
                assert kernel_calls == ["grouped_dequantize" if batched else "grouped_linear"]
                assert_matches_reference(out, reference_linear(x, weight, layer_bias), batched)


@needs_decode_kernel
def test_leading_dimensions_are_kept() -> None:
    weight = random_weight(8, 32, with_offsets=False)
    x = torch.randn(2, 3, NUM_IN, generator=torch.Generator().manual_seed(4))
    out = grouped_linear.GroupedLinearKernel(weight)(x)
    assert out.shape == (2, 3, NUM_OUT)
    assert_matches_reference(out, reference_linear(x, weight), batched=False)


@pytest.mark.parametrize(("bits", "num_in", "group"), [(8, 48, 48), (4, 40, 8)], ids=["K%32", "g%16"])
def test_a_shape_off_the_kernel_grid_runs_the_reference(bits: int, num_in: int, group: int,
                                                        kernel_calls: list[str]) -> None:
    weight = random_weight(bits, group, with_offsets=True, num_out=24, num_in=num_in)
    x = torch.randn(3, num_in, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    out = grouped_linear.GroupedLinearKernel(weight)(x, None)
    assert kernel_calls == [] and torch.equal(out, reference_linear(x, weight))


@needs_library
@pytest.mark.parametrize("num_rows", [2, 24], ids=["decode-kernel", "batched"])
@torch.inference_mode()
def test_a_cpu_graph_captures_and_replays_the_kernel(num_rows: int) -> None:
    weight = random_weight(4, 32, with_offsets=True)
    kernel = grouped_linear.GroupedLinearKernel(weight)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(num_rows, NUM_IN, generator=generator).to(torch.bfloat16)
    bias = torch.randn(NUM_OUT, generator=generator).to(torch.bfloat16)
    graph = CpuGraph.capture(lambda: kernel(x, bias) * 2)
    for _ in range(2):
        x.copy_(torch.randn(num_rows, NUM_IN, generator=generator))
        graph.replay()
        assert graph.output is not None and torch.equal(graph.output, kernel(x.clone(), bias) * 2)


class _ConvertedLayer(nn.Module):
    def __init__(self, weight: GroupedWeight | None) -> None:
        super().__init__()
        self.grouped = weight


def test_register_grouped_linear_offers_the_kernel_for_converted_layers_only() -> None:
    offered: list[tuple[Any, ...]] = []
    grouped_linear.register_grouped_linear(lambda *args, **kwargs: offered.append((*args, kwargs)), "w4-test",
                                           lambda layer: getattr(layer, "grouped", None), priority=100)
    [(op, name, build, options)] = offered
    assert (op, name, options["priority"]) == ("linear", "w4-test", 100)
    weight = random_weight(4, 32, with_offsets=True)
    assert options["supports"](_ConvertedLayer(weight)) and not options["supports"](_ConvertedLayer(None))
    x = torch.randn(2, NUM_IN, generator=torch.Generator().manual_seed(5))
    assert_matches_reference(build(_ConvertedLayer(weight))(x, None), reference_linear(x, weight), batched=False)


needs_int8_kernel = pytest.mark.skipif(library is None or not library.int8_kernel,
                                       reason="no C compiler or no AVX512-VNNI for the int8-activation kernel")


def test_activations_quantize_per_block_of_32_rounding_half_to_even() -> None:
    x = torch.zeros(1, 64)
    x[0, :4] = torch.tensor([127.0, 2.5, 3.5, -0.5])  # block 0: scale 1
    x[0, 32:34] = torch.tensor([0.1, -0.2])  # block 1: scale 0.2 / 127
    q, scales = grouped_linear.quantize_activations(x)
    assert scales[0, 0].item() == 1.0 and scales[0, 1].item() == pytest.approx(0.2 / 127)
    assert q[0, :4].tolist() == [127.0, 2.0, 4.0, -0.0]
    assert q[0, 32:34].tolist() == [64.0, -127.0]  # 0.1 / (0.2 / 127) = 63.5 -> 64
    assert q[0, 34:].abs().sum().item() == 0.0
    q_zero, scales_zero = grouped_linear.quantize_activations(torch.zeros(2, 32))
    assert scales_zero.tolist() == [[0.0], [0.0]] and q_zero.abs().sum().item() == 0.0


INT8_CASES = [(8, 16, True), (8, 32, False), (8, 128, True), (8, NUM_IN, False),
              (4, 16, True), (4, 32, True), (4, 64, True), (4, NUM_IN, True)]


@needs_int8_kernel
@pytest.mark.parametrize(("bits", "group", "with_offsets"), INT8_CASES,
                         ids=[f"W{b}-g{g}-{'off' if o else 'nooff'}" for b, g, o in INT8_CASES])
def test_int8_activations_compute_their_reference(bits: int, group: int, with_offsets: bool,
                                                  kernel_calls: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(grouped_linear.INT8_ACTIVATIONS_SWITCH, "1")
    weight = random_weight(bits, group, with_offsets)
    kernel = grouped_linear.GroupedLinearKernel(weight)
    generator = torch.Generator().manual_seed(3)
    bias = torch.randn(NUM_OUT, generator=generator)
    for num_rows in (1, 3, grouped_linear.DECODE_MAX_ROWS):
        x = torch.randn(num_rows, NUM_IN, generator=generator) * torch.rand(NUM_IN, generator=generator) * 4
        kernel_calls.clear()
        out = kernel(x, bias)
        assert kernel_calls == ["grouped_linear_q8a"]
        reference = grouped_linear.reference_int8_activations(weight, x, bias)
        assert_matches_reference(out, reference, batched=False)
        assert (out - reference_linear(x, weight, bias)).abs().max() > 1e-4  # the quantization is visible
    x16 = torch.randn(2, NUM_IN, generator=generator).to(torch.bfloat16)
    assert_matches_reference(kernel(x16), grouped_linear.reference_int8_activations(weight, x16), batched=False)


@needs_int8_kernel
def test_int8_activations_off_their_grid_run_the_exact_kernel(kernel_calls: list[str],
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(grouped_linear.INT8_ACTIVATIONS_SWITCH, "1")
    weight = random_weight(8, 48, with_offsets=True, num_out=24, num_in=576)  # g = 48: not 16, 32 or 64k
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(7))
    out = grouped_linear.GroupedLinearKernel(weight)(x)
    assert kernel_calls == ["grouped_linear_q8a", "grouped_linear"]
    assert_matches_reference(out, reference_linear(x, weight), batched=False)
