"""The CPU platform's fused layer ops (platforms/csrc/cpu_ops.c) against the
layers' own torch code, and the op-kernel registry the layers consult.

The reference is the same layer with no kernel registered. Rotary and the
residual sum round exactly as torch does, so they must match to the bit;
RMSNorm sums its squares in another order and SiLU's exp is a polynomial,
so those match to a unit in the last place of the dtype.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers.kernel_builds import NO_COMPILER

from pagedllm.model_registry.layers import op_kernels
from pagedllm.model_registry.layers.activation import SiluAndMul
from pagedllm.model_registry.layers.norm import RMSNorm
from pagedllm.model_registry.layers.rotary import RotaryEmbedding, apply_rotary_emb
from pagedllm.platforms import cpu_ops

pytestmark = NO_COMPILER

DTYPES = [torch.float32, torch.bfloat16]
# One unit in the last place, relative (float32: a few ulps of exp / sum order).
ULP = {torch.float32: 1e-6, torch.bfloat16: 2**-7}


@pytest.fixture
def no_kernels() -> Iterator[None]:
    """Run the layers' torch code; whatever was registered comes back after."""
    saved = {name: op_kernels.op_kernel(name) for name in op_kernels.OP_NAMES}
    op_kernels.unregister_op_kernels()
    yield
    op_kernels.unregister_op_kernels()
    for name, kernel in saved.items():
        if kernel is not None:
            op_kernels.register_op_kernel(name, kernel)


def _close_to_an_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), rtol=ULP[expected.dtype], atol=ULP[expected.dtype])
    if expected.dtype == torch.bfloat16:  # the odd element may round the other way; the bulk must not
        assert (actual == expected).float().mean() > 0.98


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 7, 300])  # 300 x 768 takes the parallel loop
def test_rms_norm_with_and_without_residual_matches_the_torch_layer(
    no_kernels: None, dtype: torch.dtype, rows: int
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
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_silu_and_mul_matches_the_torch_layer(no_kernels: None, dtype: torch.dtype, rows: int) -> None:
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
    no_kernels: None, dtype: torch.dtype, head_size: int, table_dtype: str
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
    assert cpu_ops.rms_norm(torch.randn(4, 2, 64), None, weight, 1e-6) is None  # per-head norm (Qwen3's q/k)
    assert cpu_ops.rms_norm(torch.randn(4, 64), None, weight.bfloat16(), 1e-6) is None  # mixed dtypes
    assert cpu_ops.silu_and_mul(torch.randn(4, 128).t()) is None  # last dim strided
    x = torch.randn(3, 2, 64)
    assert cpu_ops.rotary_embedding(x, torch.ones(3, 64, dtype=torch.float64), torch.ones(3, 64)) is None
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # a ctypes call cannot be traced
    assert cpu_ops.silu_and_mul(torch.randn(4, 128)) is None


def test_a_layer_runs_its_torch_code_when_the_kernel_declines(no_kernels: None) -> None:
    calls: list[torch.Size] = []

    def declining(gate_up: torch.Tensor) -> None:
        calls.append(gate_up.shape)

    op_kernels.register_op_kernel(op_kernels.SILU_AND_MUL, declining)
    gate_up = torch.randn(3, 8)
    out = SiluAndMul()(gate_up)
    assert calls == [torch.Size([3, 8])]
    torch.testing.assert_close(out, torch.nn.functional.silu(gate_up[:, :4]) * gate_up[:, 4:], rtol=0, atol=0)


def test_registering_an_unknown_op_is_an_error() -> None:
    with pytest.raises(ValueError, match="unknown layer op 'layer_norm'"):
        op_kernels.register_op_kernel("layer_norm", lambda x: x)


def test_the_cpu_platform_installs_the_kernels_and_the_switch_keeps_torch(
    no_kernels: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedllm.platforms.cpu import CpuPlatform

    CpuPlatform().optimize_model(torch.nn.Linear(4, 4))
    assert op_kernels.op_kernel(op_kernels.RMS_NORM) is cpu_ops.rms_norm
    assert op_kernels.op_kernel(op_kernels.ROTARY_EMBEDDING) is cpu_ops.rotary_embedding

    op_kernels.unregister_op_kernels()
    monkeypatch.setenv(cpu_ops.ENV_SWITCH, "0")
    cpu_ops.load.cache_clear()
    try:
        CpuPlatform().optimize_model(torch.nn.Linear(4, 4))
        assert op_kernels.op_kernel(op_kernels.SILU_AND_MUL) is None
    finally:
        monkeypatch.delenv(cpu_ops.ENV_SWITCH)
        cpu_ops.load.cache_clear()
