"""The example platform: found through the entry point, and picked by
platform=auto only while PAGEDLLM_EXAMPLE_PLATFORM is set."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch

from pagedllm.attention_backends.selector import select_attention_backend
from pagedllm.platforms import resolve_platform
from pagedllm.plugins import PluginManager


@pytest.fixture
def pm() -> PluginManager:
    manager = PluginManager()
    manager.load(strict=True)
    return manager


def test_platform_is_registered_through_the_entry_point(pm: PluginManager) -> None:
    registration = pm.registry("platform").get("example_accel")
    assert registration.source == f"pagedllm-example-platform {importlib.metadata.version('pagedllm-example-platform')}"


def test_auto_picks_the_example_platform_only_when_enabled(pm: PluginManager, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PAGEDLLM_EXAMPLE_PLATFORM", raising=False)
    assert resolve_platform("auto", pm).name != "example_accel"
    monkeypatch.setenv("PAGEDLLM_EXAMPLE_PLATFORM", "1")
    platform = resolve_platform("auto", pm)
    assert platform.name == "example_accel"
    selection = select_attention_backend(platform, head_size=16, dtype=torch.float32, block_size=16, load=False, plugin_manager=pm)
    # its own priority: sdpa when pagedllm-example-attention is installed, else cpu (its
    # priority names it torch_native, the built-in's old name, which still selects it)
    expected = "sdpa" if "sdpa" in pm.registry("attention_backend") else "cpu"
    assert selection.name == expected


def test_the_platforms_groups_use_its_own_communicator() -> None:
    # Plugin API 1.3: a group of one rank over gloo is enough to see the platform's collectives run.
    import torch.distributed as dist
    from pagedllm.distributed import (
        destroy_distributed_environment,
        get_distributed_init_method,
        get_open_port,
        init_distributed_environment,
    )
    from pagedllm_example_platform.platform import ExampleAcceleratorPlatform

    platform = ExampleAcceleratorPlatform()
    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    try:
        init_distributed_environment(1, 0, init_method, platform.dist_backend)
        communicator = platform.get_device_communicator(dist.new_group([0]), platform.device())
        x = torch.arange(4.0)
        assert torch.equal(communicator.all_reduce(x.clone()), x)
        assert torch.equal(communicator.all_gather(x, dim=0), x)
        assert torch.equal(communicator.broadcast(x.clone(), src=0), x)
        assert dict(communicator.calls) == {"all_reduce": 1, "all_gather": 1, "broadcast": 1}
    finally:
        destroy_distributed_environment()
