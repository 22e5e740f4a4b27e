"""Attention backend selection on simulated devices (DESIGN.md's rule)."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pagedllm.attention_backends.selector import check_backend, select_attention_backend
from pagedllm.core.errors import AttentionBackendError, UnknownComponentError
from pagedllm.platforms import resolve_platform
from pagedllm.platforms.cuda import CudaPlatform
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl
from pagedllm.plugins.registry import Registry

_real_find_spec = importlib.util.find_spec
# The registration follows TRITON_INTERPRET at the time plugins register.
TRITON_RUNS_ON_CPU = os.environ.get("TRITON_INTERPRET") == "1"


def simulate_device(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int] | None,
    installed: tuple[str, ...] = ("triton",),
) -> None:
    """capability None = CPU only. ``installed`` = which of triton/flash_attn import."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)

    def find_spec(name: str, package: str | None = None) -> Any:
        if name in ("triton", "flash_attn"):
            return object() if name in installed else None
        return _real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


FP16_128 = dict(head_size=128, dtype=torch.float16, block_size=16)
CAPABILITY_REASON = "compute capability 7.5 < 8.0 required"
NO_FLASH_REASON = "package 'flash_attn' is not installed"


@pytest.mark.parametrize(
    ("capability", "installed", "expected", "rejected"),
    [
        ((7, 5), ("triton", "flash_attn"), "triton", {"flash_attn": [CAPABILITY_REASON]}),
        ((7, 5), ("triton",), "triton", {"flash_attn": [CAPABILITY_REASON, NO_FLASH_REASON]}),
        ((8, 0), ("triton", "flash_attn"), "flash_attn", {}),
        ((8, 0), ("triton",), "triton", {"flash_attn": [NO_FLASH_REASON]}),
        ((9, 0), ("triton", "flash_attn"), "flash_attn", {}),
        ((9, 0), ("triton",), "triton", {"flash_attn": [NO_FLASH_REASON]}),
        (
            (8, 0),
            (),
            "cpu",
            {"flash_attn": [NO_FLASH_REASON], "triton": ["package 'triton' is not installed"]},
        ),
        (None, ("triton", "flash_attn"), "cpu", {}),
        (None, (), "cpu", {}),
    ],
    ids=[
        "7.5-flash", "7.5-noflash", "8.0-flash", "8.0-noflash", "9.0-flash", "9.0-noflash",
        "8.0-nothing", "cpu-flash", "cpu-noflash",
    ],
)
def test_auto_selection_matrix(
    monkeypatch: pytest.MonkeyPatch,
    capability: tuple[int, int] | None,
    installed: tuple[str, ...],
    expected: str,
    rejected: dict[str, list[str]],
) -> None:
    simulate_device(monkeypatch, capability, installed)
    platform = resolve_platform("auto")
    assert platform.name == ("cpu" if capability is None else "cuda")
    selection = select_attention_backend(platform, "auto", load=False, **FP16_128)
    assert selection.name == expected
    assert selection.rejected == rejected


def test_requested_flash_attn_on_turing_is_an_error_with_every_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_device(monkeypatch, (7, 5), installed=("triton",))
    with pytest.raises(AttentionBackendError) as info:
        select_attention_backend(
            CudaPlatform(), "flash_attn", head_size=260, dtype=torch.float32, block_size=8, load=False
        )
    assert info.value.name == "flash_attn"
    assert info.value.reasons == [
        CAPABILITY_REASON,
        "dtype float32 is not supported (supports float16, bfloat16)",
        "head size 260 is not a multiple of 8",
        "head size 260 > 256 maximum",
        "block size 8 is not a multiple of 16",
        NO_FLASH_REASON,
    ]


def test_requested_backend_never_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_device(monkeypatch, None, installed=())
    with pytest.raises(AttentionBackendError) as info:
        select_attention_backend(resolve_platform(), "triton", load=False, **FP16_128)
    # Under the Triton interpreter (this suite) the kernels run on CPU tensors.
    device_reason = [] if TRITON_RUNS_ON_CPU else ["device type 'cpu' is not supported (needs cuda)"]
    assert info.value.reasons == [*device_reason, "package 'triton' is not installed"]


def test_triton_runs_on_cpu_only_under_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.plugins.builtin import _triton_device_types

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert _triton_device_types() == ["cuda"]
    monkeypatch.delenv("TRITON_INTERPRET")
    assert _triton_device_types() == ["cuda"]
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _triton_device_types() == ["cuda", "cpu"]


def test_requested_valid_backend_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_device(monkeypatch, (7, 5), installed=("triton", "flash_attn"))
    selection = select_attention_backend(CudaPlatform(), "torch_native", load=False, **FP16_128)
    assert (selection.name, selection.rejected) == ("cpu", {})  # its old name selects it


def test_requested_unknown_backend_lists_registered_names(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_device(monkeypatch, None)
    with pytest.raises(UnknownComponentError) as info:
        select_attention_backend(resolve_platform(), "xformers", load=False, **FP16_128)
    assert info.value.kind == "attention_backend"
    assert {"cpu", "triton", "flash_attn"} <= set(info.value.known)


def test_bf16_on_turing_rejects_triton_through_the_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_device(monkeypatch, (7, 5))
    with pytest.raises(AttentionBackendError) as info:
        select_attention_backend(
            CudaPlatform(), "triton", head_size=128, dtype=torch.bfloat16, block_size=16, load=False
        )
    assert info.value.reasons == ["dtype bfloat16 is not supported by cuda (compute capability 7.5)"]


@pytest.mark.parametrize(
    ("head_size", "triton_ok", "flash_ok"),
    # Triton pads and masks any head up to 256; FlashAttention needs multiples of 8.
    [(64, True, True), (72, True, True), (48, True, True), (36, True, False), (320, False, False)],
)
def test_head_size_rules(monkeypatch: pytest.MonkeyPatch, head_size: int, triton_ok: bool, flash_ok: bool) -> None:
    simulate_device(monkeypatch, (8, 0), installed=("triton", "flash_attn"))
    registry = get_plugin_manager().attention_backends
    checks: dict[str, Any] = dict(head_size=head_size, dtype=torch.float16, block_size=32)
    assert (check_backend(registry.get("triton"), CudaPlatform(), **checks) == []) is triton_ok
    assert (check_backend(registry.get("flash_attn"), CudaPlatform(), **checks) == []) is flash_ok


# ---- plugin backends -------------------------------------------------------


class NoWindowBackendPlugin:
    @hookimpl
    def register_attention_backends(self, register: RegisterFn) -> None:
        register("no_window", "pagedllm_test_plugin.backend:TestEchoBackend", device_types=["cpu"])
        # torch dtypes are accepted and read as names, as under plugin API 1.0
        register("fp16_only", "pagedllm_test_plugin.backend:TestEchoBackend", dtypes=[torch.float16])


@pytest.fixture
def no_window_plugin() -> Iterator[None]:
    pm = get_plugin_manager()
    pm.register(NoWindowBackendPlugin(), name="no-window")
    yield
    pm.unregister(name="no-window")


def test_sliding_window_needs_declared_support(monkeypatch: pytest.MonkeyPatch, no_window_plugin: None) -> None:
    simulate_device(monkeypatch, None)
    platform = resolve_platform()
    checks: dict[str, Any] = dict(head_size=16, dtype=torch.float32, block_size=16, sliding_window=4096)
    with pytest.raises(AttentionBackendError) as info:
        select_attention_backend(platform, "no_window", load=False, **checks)
    assert info.value.reasons == ["sliding window (4096) is not supported"]
    assert select_attention_backend(platform, "auto", load=False, **checks).name == "cpu"


def test_selector_reads_the_typed_capabilities(monkeypatch: pytest.MonkeyPatch, no_window_plugin: None) -> None:
    simulate_device(monkeypatch, None)
    registration = get_plugin_manager().attention_backends.get("fp16_only")
    assert registration.info.dtypes == ("float16",)
    checks: dict[str, Any] = dict(head_size=16, block_size=16)
    assert check_backend(registration, resolve_platform(), dtype=torch.float32, **checks) == [
        "dtype float32 is not supported (supports float16)"
    ]
    assert check_backend(registration, resolve_platform(), dtype=torch.float16, **checks) == []


def test_plugin_backend_is_selected_by_name_and_loaded(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm_test_plugin.backend import TestEchoBackend

    simulate_device(monkeypatch, None)
    checks: dict[str, Any] = dict(head_size=16, dtype=torch.float32, block_size=16)
    selection = select_attention_backend(resolve_platform(), "test_echo", **checks)
    assert selection.backend_cls is TestEchoBackend
    assert selection.registration.source.startswith("pagedllm-test-plugin ")


class EchoLastResortCuda(CudaPlatform):
    def get_attention_backend_priority(self) -> list[str]:
        return ["flash_attn", "triton", "test_echo"]


def test_only_the_chosen_backend_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_device(monkeypatch, (7, 5), installed=())
    # Earlier tests may have imported the GPU backends: forget them (restored after).
    for name in list(sys.modules):
        if name.startswith(("pagedllm.attention_backends.flash_attn", "pagedllm.attention_backends.triton")):
            monkeypatch.delitem(sys.modules, name)
    loaded: list[str] = []
    real_load = Registry.load

    def spy_load(self: Registry, name: str) -> Any:
        loaded.append(name)
        return real_load(self, name)

    monkeypatch.setattr(Registry, "load", spy_load)
    selection = select_attention_backend(EchoLastResortCuda(), "auto", **FP16_128)
    assert selection.name == "test_echo"
    assert loaded == ["test_echo"]
    assert set(selection.rejected) == {"flash_attn", "triton"}
    assert "pagedllm.attention_backends.flash_attn" not in sys.modules
    assert "pagedllm.attention_backends.triton" not in sys.modules


def test_auto_with_nothing_usable_reports_each_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    simulate_device(monkeypatch, None)
    with pytest.raises(AttentionBackendError) as info:
        select_attention_backend(
            resolve_platform(), "auto", head_size=16, dtype=torch.float64, block_size=16, load=False
        )
    assert info.value.name == "auto"
    assert info.value.reasons == [
        "cpu: dtype float64 is not supported (supports float32, float16, bfloat16); "
        "dtype float64 is not supported by cpu"
    ]


# ---- what the model asks (AttentionRequirements) ---------------------------


def test_a_model_with_sinks_skips_a_backend_without_them_and_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPT-OSS on Hopper with flash_attn installed: flash_attn has no sinks, so triton serves it."""
    from pagedllm.attention_backends.base import AttentionRequirements

    simulate_device(monkeypatch, (9, 0), installed=("triton", "flash_attn"))
    gpt_oss = AttentionRequirements((64,), sliding_window=128, sinks=True)
    checks: dict[str, Any] = dict(head_size=64, dtype=torch.bfloat16, block_size=16, load=False)
    selection = select_attention_backend(CudaPlatform(), requirements=gpt_oss, **checks)
    assert selection.name == "triton"
    assert selection.rejected == {"flash_attn": ["attention sinks are not supported"]}
    # Without sinks, the same model gets flash_attn.
    assert select_attention_backend(CudaPlatform(), requirements=AttentionRequirements((64,), 128), **checks).name == (
        "flash_attn"
    )
    with pytest.raises(AttentionBackendError) as info:
        select_attention_backend(CudaPlatform(), "flash_attn", requirements=gpt_oss, **checks)
    assert info.value.reasons == ["attention sinks are not supported"]


def test_every_layers_head_size_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    """A model whose layers mix head sizes needs a backend that serves each."""
    from pagedllm.attention_backends.base import AttentionRequirements

    simulate_device(monkeypatch, (8, 0), installed=("triton", "flash_attn"))
    registry = get_plugin_manager().attention_backends
    mixed = AttentionRequirements((64, 36, 320))
    checks: dict[str, Any] = dict(head_size=64, dtype=torch.float16, block_size=32, requirements=mixed)
    assert check_backend(registry.get("flash_attn"), CudaPlatform(), **checks) == [
        "head size 36 is not a multiple of 8", "head size 320 > 256 maximum"
    ]
    assert check_backend(registry.get("triton"), CudaPlatform(), **checks) == ["head size 320 > 256 maximum"]


def test_soft_cap_and_sinks_need_declared_support(monkeypatch: pytest.MonkeyPatch, no_window_plugin: None) -> None:
    """A plugin backend that declares neither is refused both, each with its reason."""
    from pagedllm.attention_backends.base import AttentionRequirements

    simulate_device(monkeypatch, None)
    registration = get_plugin_manager().attention_backends.get("no_window")
    asks = AttentionRequirements((16,), logits_soft_cap=50.0, sinks=True)
    assert check_backend(registration, resolve_platform(), head_size=16, dtype=torch.float32, block_size=16,
                         requirements=asks) == [
        "attention logit soft cap (50) is not supported", "attention sinks are not supported"
    ]
    assert (registration.info.supports_logits_soft_cap, registration.info.supports_sinks) == (False, False)
    cpu = get_plugin_manager().attention_backends.get("cpu")
    assert (cpu.info.supports_logits_soft_cap, cpu.info.supports_sinks) == (True, True)
