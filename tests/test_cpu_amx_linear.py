"""The AMX linear kernel for few-row bfloat16 batches: what F.linear
computes, to within its summation order (float32 sums, one bf16 rounding)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers.kernel_builds import NO_COMPILER, build_for_march, cpu_flags
from torch import nn

from pagedllm.model_registry.layers.linear import ColumnParallelLinear
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cpu import amx_linear as cpu_amx_linear
from pagedllm.platforms.cpu.linear import onednn_linear_available
from pagedllm.worker.layer_ops import prepare_layer_ops

pytestmark = [
    NO_COMPILER,
    pytest.mark.skipif(not {"amx_bf16", "amx_tile", "avx512_bf16"} <= cpu_flags(), reason="this CPU has no AMX-BF16"),
]


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact product (float64 sums of exact bf16 products), rounded once to bf16."""
    out = x.double() @ weight.double().T
    if bias is not None:
        out += bias.double()
    return out.float().to(torch.bfloat16)


def _assert_rounds_like_reference(
    out: torch.Tensor, expected: torch.Tensor, x: torch.Tensor, weight: torch.Tensor
) -> None:
    """The kernel's float32 sum is the exact one to within float32's rounding
    of each partial sum (K * 2^-24 * sum |x w|); rounded to bf16 it is the
    exact result's rounding, or (near a rounding boundary, rarely) the next
    bf16 value: at most one bf16 step (2^-7 relative) off."""
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    sum_error = x.shape[1] * 2.0**-24 * (x.double().abs() @ weight.double().abs().T)
    bound = expected.double().abs() * 2.0**-7 + sum_error
    assert bool(((out.double() - expected.double()).abs() <= bound).all())
    assert (out == expected).double().mean().item() > 0.99


@pytest.mark.parametrize(("rows", "num_out", "num_in"), [
    (1, 768, 768), (7, 100, 64), (16, 32, 32), (17, 1280, 768), (32, 4096, 96), (33, 50, 2048), (64, 31, 128),
    (100, 65, 64),
])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_the_exact_product_rounded_to_bfloat16(
    rows: int, num_out: int, num_in: int, with_bias: bool
) -> None:
    generator = torch.Generator().manual_seed(rows * 7 + num_out)
    x = torch.randn(rows, num_in, generator=generator).to(torch.bfloat16)
    weight = torch.randn(num_out, num_in, generator=generator).to(torch.bfloat16)
    bias = torch.randn(num_out, generator=generator).to(torch.bfloat16) if with_bias else None
    packed = cpu_amx_linear.pack(weight)
    assert packed is not None
    out = cpu_amx_linear.linear(x, packed, num_out, bias)
    assert out is not None
    _assert_rounds_like_reference(out, _reference(x, weight, bias), x, weight)


@pytest.mark.parametrize(("rows", "num_out", "num_in"), [(1, 768, 768), (17, 100, 64), (32, 4096, 96), (64, 33, 2048)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_kernel_matches_the_exact_scaled_product_rounded_to_bfloat16(
    rows: int, num_out: int, num_in: int, with_bias: bool
) -> None:
    """y = (x . q^T) * scale + bias: int8 weights widened exactly (the whole
    range, -128 and 127 included), each column's float32 sum scaled once."""
    generator = torch.Generator().manual_seed(rows + num_out)
    x = torch.randn(rows, num_in, generator=generator).to(torch.bfloat16)
    q = torch.randint(-128, 128, (num_out, num_in), generator=generator, dtype=torch.int8)
    q[0, :2] = torch.tensor([-128, 127], dtype=torch.int8)
    scale = (torch.rand(num_out, generator=generator) * 0.02 + 1e-3).to(torch.bfloat16)
    bias = torch.randn(num_out, generator=generator).to(torch.bfloat16) if with_bias else None
    packed = cpu_amx_linear.pack_int8(q)
    assert packed is not None and packed.dtype == torch.int8
    out = cpu_amx_linear.linear_int8(x, packed, scale, bias)
    assert out is not None
    exact = (x.double() @ q.double().T) * scale.double()
    if bias is not None:
        exact += bias.double()
    expected = exact.float().to(torch.bfloat16)
    sum_error = num_in * 2.0**-24 * (x.double().abs() @ q.double().abs().T) * scale.double()
    bound = expected.double().abs() * 2.0**-7 + sum_error
    assert bool(((out.double() - expected.double()).abs() <= bound).all())
    assert (out == expected).double().mean().item() > 0.99


def test_kernel_reads_rows_at_their_stride_and_propagates_nan() -> None:
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(20, 160, generator=generator).to(torch.bfloat16)
    x = wide[:, 32:96]  # rows 160 elements apart
    x_with_nan = x.clone()
    x_with_nan[5, 3] = float("nan")
    weight = torch.randn(40, 64, generator=generator).to(torch.bfloat16)
    packed = cpu_amx_linear.pack(weight)
    assert packed is not None
    out = cpu_amx_linear.linear(x, packed, 40, None)
    assert out is not None
    _assert_rounds_like_reference(out, _reference(x, weight, None), x, weight)
    out_nan = cpu_amx_linear.linear(x_with_nan, packed, 40, None)
    assert out_nan is not None
    assert bool(out_nan[5].isnan().all()) and not bool(out_nan[[4, 6]].isnan().any())


def test_pack_refuses_what_the_kernel_cannot_take() -> None:
    assert cpu_amx_linear.pack(torch.randn(8, 48).to(torch.bfloat16)) is None  # K not a multiple of 32
    assert cpu_amx_linear.pack(torch.randn(8, 64)) is None  # float32
    assert cpu_amx_linear.pack_int8(torch.zeros(8, 48, dtype=torch.int8)) is None
    assert cpu_amx_linear.pack_int8(torch.zeros(8, 64).to(torch.bfloat16)) is None  # pack_int8 takes int8 only
    packed = cpu_amx_linear.pack(torch.randn(8, 64).to(torch.bfloat16))
    assert packed is not None
    assert cpu_amx_linear.linear(torch.randn(2, 64), packed, 8, None) is None  # float32 rows
    assert cpu_amx_linear.linear(torch.randn(64, 2).to(torch.bfloat16).T, packed, 8, None) is None  # strided elements
    with pytest.raises(ValueError, match="packed weight"):  # K of another weight: would read past the packed one
        cpu_amx_linear.linear(torch.randn(2, 96).to(torch.bfloat16), packed, 8, None)


def test_layers_run_few_rows_on_the_kernel_and_more_on_onednn() -> None:
    """Batches of at most AMX_MAX_ROWS rows (decode) take the kernel; larger
    ones keep oneDNN's prepacked GEMM, bit-identical to F.linear; a weight the
    kernel cannot take (K = 48) keeps oneDNN at every size."""
    if not onednn_linear_available(torch.bfloat16):
        pytest.skip("oneDNN's prepacked linear does not run in bfloat16 here")
    torch.manual_seed(0)
    model = nn.Sequential(ColumnParallelLinear(64, 96, bias=True), ColumnParallelLinear(96, 48),
                          ColumnParallelLinear(48, 80)).to(torch.bfloat16)
    weights = [(layer.weight.detach().clone(), None if layer.bias is None else layer.bias.detach().clone())
               for layer in model]
    generator = torch.Generator().manual_seed(1)
    few = torch.randn(cpu_amx_linear.AMX_MAX_ROWS, 64, generator=generator).to(torch.bfloat16)
    many = torch.randn(cpu_amx_linear.AMX_MAX_ROWS + 1, 64, generator=generator).to(torch.bfloat16)
    with torch.no_grad():
        assert prepare_layer_ops(model, CpuPlatform())["cpu_prepacked"] == 3
        for x in (few, many):
            h = x
            for layer, (weight, bias) in zip(model, weights, strict=True):
                out = layer(h)
                if len(x) <= cpu_amx_linear.AMX_MAX_ROWS and weight.shape[1] % 32 == 0:
                    packed = cpu_amx_linear.pack(weight)
                    assert packed is not None
                    assert torch.equal(out, cpu_amx_linear.linear(h, packed, weight.shape[0], bias))
                    _assert_rounds_like_reference(out, _reference(h, weight, bias), h, weight)
                else:
                    assert torch.equal(out, F.linear(h, weight, bias))
                h = out
        assert model[0](few.view(8, 8, 64)).shape == (8, 8, 96)  # leading dims kept


def test_switch_off_keeps_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_amx_linear, "load", lambda: None)
    assert cpu_amx_linear.pack(torch.randn(8, 64).to(torch.bfloat16)) is None


def test_a_build_without_amx_says_so(tmp_path: Path) -> None:
    """Built for a CPU without AMX (AVX-512 only), the library loads and
    reports the kernel unavailable, so pack() leaves layers on oneDNN."""
    library = build_for_march(cpu_amx_linear.SOURCE, cpu_amx_linear.CFLAGS, "skylake-avx512", tmp_path)
    assert library.amx_linear_available() == 0
