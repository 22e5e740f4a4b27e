"""The CPU platform's fused layer ops (platforms/cpu/csrc/cpu_ops.c) against the
layers' own torch code, and the op registry that binds them to the layers.

The reference is the same layer with no kernel bound (a layer runs its
torch code until the op registry binds it). Rotary and the
residual sum round exactly as torch does, so they must match to the bit;
RMSNorm sums its squares in another order and SiLU's exp is a polynomial,
so those match to a unit in the last place of the dtype. In bfloat16 on
AVX-512 the RMSNorm sum order is fixed, so there the reference is torch's op
sequence summing in that order, to the bit.
"""

from __future__ import annotations

import ctypes
import platform

import pytest
import torch
from helpers.kernel_builds import NO_COMPILER, build_for_march, cpu_flags

from pagedllm.model_registry.layers.activation import SiluAndMul
from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.layers.ops import SILU_AND_MUL, OpRegistry, bind_layer_ops
from pagedllm.model_registry.layers.rotary import ApplyRotaryEmb, RotaryEmbedding, apply_rotary_emb
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cpu import fused_ops as cpu_ops
from pagedllm.worker.layer_ops import prepare_layer_ops

pytestmark = NO_COMPILER

DTYPES = [torch.float32, torch.bfloat16]
# One unit in the last place, relative (float32: a few ulps of exp / sum order).
ULP = {torch.float32: 1e-6, torch.bfloat16: 2**-7}


def _close_to_an_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=ULP[expected.dtype], atol=ULP[expected.dtype])
    if expected.dtype == torch.bfloat16:  # the odd element may round the other way; the bulk must not
        assert (actual == expected).float().mean() > 0.98


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 768 takes the parallel loop
def test_rms_norm_with_and_without_residual_matches_the_torch_layer(
    dtype: torch.dtype, rows: int
) -> None:
    generator = torch.Generator().manual_seed(rows)
    norm = RMSNorm(768, eps=1e-5).to(dtype)
    norm.weight.data = torch.randn(768, generator=generator).to(dtype)
    wide = torch.randn(rows, 1024, generator=generator).to(dtype)
    x = wide[:, :768]  # rows at a stride, as a slice of a wider activation
    residual = torch.randn(rows, 768, generator=generator).to(dtype)
    expected_plain = norm(x)
    expected_out, expected_sum = norm(x, residual)

    plain = cpu_ops.rms_norm(x, None, norm.weight, norm.eps)
    fused = cpu_ops.rms_norm(x, residual, norm.weight, norm.eps)
    assert isinstance(plain, torch.Tensor) and isinstance(fused, tuple)
    _close_to_an_ulp(plain, expected_plain)
    out, summed = fused
    assert torch.equal(summed, expected_sum)  # one rounding of x + residual, as torch's add
    _close_to_an_ulp(out, expected_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens", [1, 5])
def test_per_head_rms_norm_of_a_qkv_slice_matches_the_torch_layer(dtype: torch.dtype, tokens: int) -> None:
    """Qwen3's q/k norms: x [T, heads, D], a slice of the fused qkv (rows
    not evenly strided past one token), normed per head."""
    generator = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(64, eps=1e-6).to(dtype)
    norm.weight.data = torch.randn(64, generator=generator).to(dtype)
    qkv = torch.randn(tokens, 8 * 64, generator=generator).to(dtype)
    q = qkv[:, : 4 * 64].view(tokens, 4, 64)
    out = cpu_ops.rms_norm(q, None, norm.weight, norm.eps)
    assert isinstance(out, torch.Tensor) and out.shape == q.shape
    _close_to_an_ulp(out, norm(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_and_mul_matches_the_torch_layer(dtype: torch.dtype, rows: int) -> None:
    generator = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 1408, generator=generator) * 6).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamps and silu(0)
    expected = SiluAndMul()(gate_up)
    fused = cpu_ops.silu_and_mul(gate_up)
    assert fused is not None
    _close_to_an_ulp(fused, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 32, 80])
@pytest.mark.parametrize("table_dtype", ["float32", "model"])  # the model's buffers follow its dtype
def test_rotary_matches_the_torch_code_to_the_bit_in_place(
    dtype: torch.dtype, head_size: int, table_dtype: str
) -> None:
    generator = torch.Generator().manual_seed(head_size)
    tokens, q_heads, kv_heads = 37, 6, 2
    rope = RotaryEmbedding(head_size, 4096, {"rope_theta": 10000.0, "rope_type": "default"})
    if table_dtype == "model":
        rope = rope.to(dtype)
    cos, sin = rope(torch.randint(0, 4096, (tokens,), generator=generator))
    # q and k heads as the model rotates them: a view into the fused qkv rows
    qkv = torch.randn(tokens, (q_heads + 2 * kv_heads) * head_size, generator=generator).to(dtype)
    qk = qkv[:, : (q_heads + kv_heads) * head_size].view(tokens, q_heads + kv_heads, head_size)
    v_before = qkv[:, (q_heads + kv_heads) * head_size :].clone()
    expected = apply_rotary_emb(qk, cos, sin)

    rotated = cpu_ops.rotary_embedding(qk, cos, sin)
    assert rotated is qk  # in place
    assert torch.equal(rotated, expected)
    assert torch.equal(qkv[:, (q_heads + kv_heads) * head_size :], v_before)  # v untouched


def test_inputs_the_kernels_do_not_take_fall_back_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.ones(64)
    assert cpu_ops.rms_norm(torch.randn(4, 64, dtype=torch.float16), None, weight.half(), 1e-6) is None
    assert cpu_ops.rms_norm(torch.randn(4, 64), None, weight.bfloat16(), 1e-6) is None  # mixed dtypes
    assert cpu_ops.silu_and_mul(torch.randn(4, 128).t()) is None  # last dim strided
    x = torch.randn(3, 2, 64)
    assert cpu_ops.rotary_embedding(x, torch.ones(3, 64, dtype=torch.float64), torch.ones(3, 64)) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a ctypes call cannot be traced
    assert cpu_ops.silu_and_mul(torch.randn(4, 128)) is None


def test_a_layer_runs_its_torch_code_when_the_kernel_declines() -> None:
    calls: list[torch.Size] = []

    def declining(gate_up: torch.Tensor) -> None:
        calls.append(gate_up.shape)

    registry = OpRegistry()
    registry.register(SILU_AND_MUL, "declining", lambda layer: declining)
    layer = SiluAndMul()
    assert bind_layer_ops(layer, registry) == {"declining": 1}
    gate_up = torch.randn(3, 8)
    out = layer(gate_up)
    assert calls == [torch.Size([3, 8])]
    torch.testing.assert_close(out, torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:], rtol=0, atol=0)


def test_registering_an_unknown_op_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown layer op 'layer_norm'"):
        OpRegistry().register("layer_norm", "mine", lambda layer: lambda x: x)


def _cpu_bound_layers() -> tuple[RMSNorm, SiluAndMul, ApplyRotaryEmb]:
    layers = (RMSNorm(8), SiluAndMul(), ApplyRotaryEmb())
    prepare_layer_ops(torch.nn.ModuleList(layers), CpuPlatform())
    return layers


def test_the_cpu_platform_binds_the_kernels_and_the_switch_keeps_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    norm, act, rotary = _cpu_bound_layers()
    assert (norm.op_kernel, act.op_kernel, rotary.op_kernel) == (
        cpu_ops.rms_norm, cpu_ops.silu_and_mul, cpu_ops.rotary_embedding)
    assert norm.op_impl == act.op_impl == rotary.op_impl == "cpu_fused"

    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    cpu_ops.load.cache_clear()
    try:
        for layer in _cpu_bound_layers():
            assert (layer.op_impl, layer.op_kernel) == ("torch", None)
    finally:
        monkeypatch.delenv(cpu_ops.ENV_SWITCH)
        cpu_ops.load.cache_clear()


# The explicit AVX-512 code paths (bfloat16 RMSNorm, rotary; the even/odd
# layout and the pairwise roundings of cpu_kernel_math.h) against torch to
# the bit, on awkward lengths, strided rows and special values, in this
# CPU's build and in builds for older CPUs: skylake-avx512 has AVX-512 but
# rounds by integers (no AVX512-BF16), x86-64-v3 runs the portable loops.
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
BUILDS = {"native": AVX512, "skylake-avx512": AVX512, "x86-64-v3": {"avx2", "fma"}}
DENORMALS = [1e-39, -3e-40, 3.7e-40]  # bfloat16 denormals (and float32 ones)


_older_builds: dict[str, ctypes.CDLL] = {}


@pytest.fixture(params=list(BUILDS))
def build(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
          monkeypatch: pytest.MonkeyPatch) -> str:
    """cpu_ops running the kernels built for this CPU or for an older one."""
    march: str = request.param
    if march != "native":
        if platform.machine() != "x86_64" or not BUILDS[march] <= cpu_flags():
            pytest.skip(f"this CPU cannot run -march={march} code")
        if march not in _older_builds:  # one build per march for the whole module
            library = build_for_march(cpu_ops.SOURCE, cpu_ops.CFLAGS, march, tmp_path_factory.mktemp(march))
            for name, argtypes in cpu_ops._SIGNATURES.items():
                getattr(library, name).restype, getattr(library, name).argtypes = None, argtypes
            _older_builds[march] = library
        monkeypatch.setattr(cpu_ops, "load", lambda: _older_builds[march])
    elif not AVX512.issubset(cpu_flags()):
        pytest.skip("this CPU has no AVX-512: the native build is the portable one")
    return march


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Equal to the bit, but that any NaN matches any NaN (torch's own NaN
    patterns differ between its scalar and vector conversions)."""
    assert torch.equal(actual.isnan(), expected.isnan())
    keep = ~expected.isnan()
    integer = torch.int16 if expected.dtype == torch.bfloat16 else torch.int32
    assert torch.equal(actual[keep].view(integer), expected[keep].view(integer))


def _rows_with_special_values(rows: int, hidden: int, generator: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """rows x hidden normal values, a few rows with NaN, inf, zeros, huge or
    denormal values, the last in a row with normal ones (its products with
    the norm's scale are denormal too: a conversion that flushes them fails)."""
    x = torch.randn(rows, hidden, generator=generator) * 3
    x[0, hidden // 2] = float("nan")
    x[1 % rows, hidden - 1] = float("inf")
    x[2 % rows] = 0.0
    x[3 % rows, : min(hidden, 3)] = 3e38
    columns = range(0, hidden, max(1, hidden // 7))
    x[4 % rows, columns] = torch.tensor(DENORMALS).repeat(hidden)[: len(columns)]
    return x.to(dtype)


def _rms_norm_in_kernel_order(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                              lanes: int, lane_order: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """torch's bfloat16 RMSNorm op sequence with the sum of squares in the
    kernel's order: `lanes` running sums, one per position in each `lanes`
    elements, the last hidden % lanes added one by one to the first, then
    the lanes in order (or in `lane_order`)."""
    summed = x if residual is None else x + residual
    s = summed.float()
    rows, hidden = s.shape
    body = hidden - hidden % lanes
    squares = s * s
    acc = torch.zeros(rows, lanes)
    for start in range(0, body, lanes):
        acc = acc + squares[:, start : start + lanes]
    for j in range(body, hidden):
        acc[:, 0] = acc[:, 0] + squares[:, j]
    total = torch.zeros(rows)
    for lane in range(lanes) if lane_order is None else lane_order:
        total = total + acc[:, lane]
    # 1 / sqrtf(sum / hidden + eps), each step rounded once to float32: done
    # in float64 and rounded, which is exact for these operations on float32
    # inputs. torch's own float32 sqrt is not correctly rounded on every CPU
    # (one ulp off for some inputs on an AMD EPYC).
    mean = (total.double() / hidden).float() + torch.tensor(eps, dtype=torch.float32)
    inv = (1.0 / mean.double().sqrt().float().double()).float()
    return weight * (s * inv[:, None]).to(x.dtype), summed


@pytest.mark.parametrize("hidden", [768, 100, 33, 31, 1])
@pytest.mark.parametrize("rows", [7, 300])  # 300 x 768 takes the parallel loop
@pytest.mark.parametrize("with_residual", [True, False])
def test_bf16_rms_norm_is_torch_with_the_kernels_sum_order_to_the_bit(
    build: str, hidden: int, rows: int, with_residual: bool
) -> None:
    generator = torch.Generator().manual_seed(hidden + rows)
    wide = torch.zeros(rows, hidden + 9, dtype=torch.bfloat16)
    x = wide[:, 3 : 3 + hidden]  # rows at a stride, not 64-byte aligned
    x.copy_(_rows_with_special_values(rows, hidden, generator, torch.bfloat16))
    residual = (torch.randn(rows, hidden, generator=generator)).to(torch.bfloat16) if with_residual else None
    if residual is not None:
        residual[5 % rows, 0] = 1e-39  # x + residual rounds to a denormal: the stored sum keeps it
        x[5 % rows, 0] = 0.0
    weight = torch.randn(hidden, generator=generator).to(torch.bfloat16)
    weight[-1] = 1e-39

    result = cpu_ops.rms_norm(x, residual, weight, 1e-5)
    assert result is not None
    out, summed = result if isinstance(result, tuple) else (result, x)
    expected_out, expected_summed = _rms_norm_in_kernel_order(x, residual, weight, 1e-5, lanes=32)
    _assert_same_bits(summed, expected_summed)
    if build == "x86-64-v3":  # the compiler's vectorisation picks the portable loop's sum order
        torch.testing.assert_close(out.float(), expected_out.float(), rtol=2**-7, atol=2**-7, equal_nan=True)
    else:
        _assert_same_bits(out, expected_out)


# The AVX-512 builds only: the portable loop's order is the compiler's.
@pytest.mark.parametrize("build", ["native", "skylake-avx512"], indirect=True)
@pytest.mark.parametrize("hidden", [64, 71])
def test_bf16_rms_norm_sum_order_is_the_one_the_reference_states(build: str, hidden: int) -> None:
    """The order shows in the odd row only, so: many rows of a wide range of
    magnitudes, where summing the lanes in another order changes some."""
    generator = torch.Generator().manual_seed(hidden)
    magnitudes = torch.exp2(torch.randint(-8, 9, (20000, hidden), generator=generator).float())
    x = (torch.randn(20000, hidden, generator=generator) * magnitudes).to(torch.bfloat16)
    weight = torch.ones(hidden, dtype=torch.bfloat16)
    out = cpu_ops.rms_norm(x, None, weight, 1e-5)
    assert isinstance(out, torch.Tensor)

    expected, _ = _rms_norm_in_kernel_order(x, None, weight, 1e-5, lanes=32)
    _assert_same_bits(out, expected)
    for other_order in [list(range(31, -1, -1)), list(range(0, 32, 2)) + list(range(1, 32, 2))]:
        other, _ = _rms_norm_in_kernel_order(x, None, weight, 1e-5, lanes=32, lane_order=other_order)
        assert not torch.equal(other, expected)  # the data tells the orders apart


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 80, 2, 96])  # 80 and 2 end in a masked block; 96: one of 16 then 32
def test_rotary_with_special_values_matches_torch_to_the_bit(
    build: str, dtype: torch.dtype, head_size: int
) -> None:
    generator = torch.Generator().manual_seed(head_size)
    tokens, heads = 9, 5
    rope = RotaryEmbedding(head_size, 4096, {"rope_theta": 10000.0, "rope_type": "default"}).to(dtype)
    cos, sin = rope(torch.randint(0, 4096, (tokens,), generator=generator))
    qkv = _rows_with_special_values(tokens, (heads + 1) * head_size, generator, dtype)
    qk = qkv[:, : heads * head_size].view(tokens, heads, head_size)
    v_before = qkv[:, heads * head_size :].clone()
    expected = apply_rotary_emb(qk, cos, sin)

    assert cpu_ops.rotary_embedding(qk, cos, sin) is qk
    _assert_same_bits(qk, expected)
    assert torch.equal(qkv[:, heads * head_size :], v_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [64, 1408, 37])
def test_silu_and_mul_keeps_denormal_results_as_torch_does(
    build: str, dtype: torch.dtype, width: int
) -> None:
    generator = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(4, 2 * width, generator=generator) * 4).to(dtype)
    gate_up[0, :3] = torch.tensor(DENORMALS, dtype=dtype)  # silu of a denormal: half of it, times 1
    gate_up[0, width : width + 3] = 1.0
    gate_up[1, :3] = 2.0  # silu(2) times a denormal up
    gate_up[1, width : width + 3] = torch.tensor(DENORMALS, dtype=dtype)
    gate_up[2, [1, width + 1]] = torch.tensor([float("nan"), 1.0], dtype=dtype)
    gate_up[3, [2, width + 2]] = torch.tensor([2.0, float("inf")], dtype=dtype)
    expected = SiluAndMul()(gate_up)

    out = cpu_ops.silu_and_mul(gate_up)
    assert out is not None
    for row, columns in [(0, slice(0, 3)), (1, slice(0, 3)), (2, slice(1, 2)), (3, slice(2, 3))]:
        _assert_same_bits(out[row, columns], expected[row, columns])
    assert (out[:2, :3] != 0).all()  # kept, not flushed to zero
    _close_to_an_ulp(out[:, 3:], expected[:, 3:])


def test_silu_and_mul_over_every_bfloat16_gate(build: str) -> None:
    """Every bfloat16 value as a gate (the AVX512-BF16 build looks silu up in
    a table of all of them), up = 1: NaN where torch has NaN, elsewhere
    torch's value to an ulp, denormal results included. Below -88.7 exp is
    clamped (silu is g / 3.4e38 there, where torch's is ~0, and -inf at -inf,
    where torch's is NaN): left out."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gate_up = torch.cat([gate, torch.ones_like(gate)]).view(1, -1)
    expected = SiluAndMul()(gate_up)[0]

    out = cpu_ops.silu_and_mul(gate_up)
    assert out is not None
    compared = gate.isnan() | (gate >= -88.7)
    assert torch.equal(out[0][compared].isnan(), expected[compared].isnan())
    compared &= ~gate.isnan()
    _close_to_an_ulp(out[0][compared], expected[compared])
