"""Platforms: availability and capability through torch.cuda, dtype rules, resolution."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pagedllm.core.errors import ConfigError, UnknownComponentError
from pagedllm.platforms import resolve_platform
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cuda import CudaPlatform
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl


def simulate_cuda(monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] | None) -> None:
    """capability None = no GPU; otherwise a GPU of that compute capability."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)


def test_cpu_platform_facts() -> None:
    cpu = CpuPlatform()
    assert CpuPlatform.is_available()
    assert (cpu.name, cpu.device_type, cpu.device()) == ("cpu", "cpu", torch.device("cpu"))
    assert cpu.get_device_capability() is None
    assert cpu.get_attention_backend_priority() == ["cpu"]
    assert set(cpu.supported_dtypes()) == {torch.float32, torch.float16, torch.bfloat16}
    assert 0 < cpu.free_memory_bytes() <= cpu.total_memory_bytes()
    assert cpu.get_device_name()


@pytest.mark.parametrize(
    ("capability", "has_bf16"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)]
)
def test_cuda_reads_capability_from_torch_and_gates_bf16(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int], has_bf16: bool
) -> None:
    simulate_cuda(monkeypatch, capability)
    cuda = CudaPlatform()
    assert CudaPlatform.is_available()
    assert cuda.get_device_capability() == capability
    assert (torch.bfloat16 in cuda.supported_dtypes()) is has_bf16
    assert torch.float16 in cuda.supported_dtypes()
    assert cuda.get_attention_backend_priority() == ["flash_attn", "triton", "cpu"]
    assert cuda.device() == torch.device("cuda", 0)
    assert cuda.describe() == f"cuda (compute capability {capability[0]}.{capability[1]})"


def test_auto_picks_cuda_when_available_else_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, None)
    assert isinstance(resolve_platform("auto"), CpuPlatform)
    simulate_cuda(monkeypatch, (8, 0))
    assert isinstance(resolve_platform(), CudaPlatform)


def test_named_platform_comes_from_the_registry(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, (8, 6))
    assert isinstance(resolve_platform("cpu"), CpuPlatform)  # explicit cpu even with a GPU
    assert isinstance(resolve_platform("cuda"), CudaPlatform)


def test_unavailable_named_platform_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, None)
    with pytest.raises(ConfigError) as info:
        resolve_platform("cuda")
    assert info.value.key == "platform"
    assert info.value.value == "cuda"
    assert "auto, cpu" in info.value.allowed


def test_unknown_platform_lists_the_registered_ones() -> None:
    with pytest.raises(UnknownComponentError, match=r"no platform named 'tpu'; registered: cpu, cuda"):
        resolve_platform("tpu")


class FakeAccelerator(CpuPlatform):
    name = "fake_accel"

    def get_attention_backend_priority(self) -> list[str]:
        return ["test_echo", "torch_native"]


class FakePlatformPlugin:
    @hookimpl
    def register_platforms(self, register: RegisterFn) -> None:
        register("fake_accel", FakeAccelerator, device_type="cpu")


@pytest.fixture
def fake_platform_plugin() -> Iterator[None]:
    pm = get_plugin_manager()
    pm.register(FakePlatformPlugin(), name="fake-platform")
    yield
    pm.unregister(name="fake-platform")


def test_plugin_platform_is_resolved_by_name(fake_platform_plugin: None) -> None:
    platform = resolve_platform("fake_accel")
    assert type(platform) is FakeAccelerator
    assert get_plugin_manager().registry("platform").get("fake_accel").source == "fake-platform"


def test_available_plugin_platform_wins_auto_over_the_builtins(
    fake_platform_plugin: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # vLLM's rule: one available out-of-tree platform beats cpu and even cuda.
    simulate_cuda(monkeypatch, (8, 0))
    assert type(resolve_platform("auto")) is FakeAccelerator
    monkeypatch.setattr(FakeAccelerator, "is_available", classmethod(lambda cls: False))
    assert type(resolve_platform("auto")) is CudaPlatform  # unavailable: the built-in order again


@pytest.mark.parametrize(
    ("capability", "requested", "model_dtype", "expected"),
    [
        (None, "half", torch.float32, torch.float16),
        ((7, 5), "auto", torch.bfloat16, torch.float16),  # Turing has no bf16
        ((7, 5), "auto", torch.float32, torch.float32),
        ((8, 0), "auto", torch.bfloat16, torch.bfloat16),
        ((8, 0), "float16", torch.bfloat16, torch.float16),
    ],
)
def test_resolve_dtype(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int] | None,
    requested: str,
    model_dtype: torch.dtype,
    expected: torch.dtype,
) -> None:
    simulate_cuda(monkeypatch, capability)
    platform = CpuPlatform() if capability is None else CudaPlatform()
    assert platform.resolve_dtype(requested, model_dtype) == expected


# A Sapphire Rapids core's bfloat16 flags, an AVX-512 core without them, a
# Neoverse V1's (Arm), an AVX2 laptop.
SAPPHIRE_RAPIDS = {"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8"}
SKYLAKE = {"avx2", "avx512f", "avx512bw"}
NEOVERSE_V1 = {"fp", "asimd", "sve", "bf16", "svebf16"}
HASWELL = {"avx", "avx2", "fma"}


@pytest.mark.parametrize(("flags", "model_dtype", "expected"), [
    (SAPPHIRE_RAPIDS, torch.bfloat16, torch.bfloat16),
    (SAPPHIRE_RAPIDS, torch.float16, torch.bfloat16),  # float16 has no fast CPU path: bfloat16 instead
    (SAPPHIRE_RAPIDS, torch.float32, torch.float32),  # a float32 checkpoint stays float32
    (NEOVERSE_V1, torch.float16, torch.bfloat16),
    (SKYLAKE, torch.bfloat16, torch.float32),  # AVX-512 alone emulates bfloat16: float32 is faster
    (HASWELL, torch.float16, torch.float32),
    (set(), torch.bfloat16, torch.float32),  # no /proc/cpuinfo
])
def test_auto_on_cpu_is_bfloat16_only_for_half_checkpoints_on_native_bf16_cpus(
    monkeypatch: pytest.MonkeyPatch, flags: set[str], model_dtype: torch.dtype, expected: torch.dtype
) -> None:
    from pagedllm.platforms.cpu import platform as cpu

    monkeypatch.setattr(cpu, "read_cpu_flags", lambda: flags)
    assert CpuPlatform().resolve_dtype("auto", model_dtype) == expected
    # An explicit dtype is what runs, whatever the flags.
    assert CpuPlatform().resolve_dtype("float16", torch.bfloat16) == torch.float16
    assert CpuPlatform().resolve_dtype("bfloat16", torch.float32) == torch.bfloat16


def test_cpu_flags_come_from_proc_cpuinfo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import builtins

    from pagedllm.platforms.cpu import platform as cpu

    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nmodel name\t: Xeon\nflags\t\t: fpu avx512f amx_bf16\n\nprocessor\t: 1\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(fake if path == "/proc/cpuinfo" else path,
                                                                          *a, **k))
    assert cpu.read_cpu_flags() == {"fpu", "avx512f", "amx_bf16"}
    fake.write_text("processor\t: 0\nFeatures\t: fp asimd bf16\n")
    assert cpu.read_cpu_flags() == {"fp", "asimd", "bf16"}


def test_explicit_bf16_below_capability_8_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_cuda(monkeypatch, (7, 5))
    with pytest.raises(ConfigError) as info:
        CudaPlatform().resolve_dtype("bfloat16", torch.float32)
    assert str(info.value) == (
        "dtype='bfloat16' is invalid; allowed: float16, float32 on cuda (compute capability 7.5)"
    )


def test_unknown_dtype_name_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"dtype='float8' is invalid; allowed: auto, float32"):
        CpuPlatform().resolve_dtype("float8", torch.float32)
