"""A stand-in vendor accelerator: the CPU, gated by an env var, with its own
attention backend priority."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm_example_platform import ENABLE_ENV, PLATFORM_NAME

if TYPE_CHECKING:
    from pagedllm_example_platform.communicator import ExampleCommunicator


class ExampleAcceleratorPlatform(CpuPlatform):
    name = PLATFORM_NAME
    device_type = "cpu"  # a torch device type; a real vendor has its own (e.g. "xpu")
    # Plugin API 1.3: the torch.distributed backend of its process groups
    # (a vendor names its own, e.g. "xccl"); older pagedllm ignores it.
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        # NOTE: read at call time, in every process: the serve engine core
        # inherits the variable and decides the same way.
        return os.environ.get(ENABLE_ENV, "") not in ("", "0")

    def get_device_name(self) -> str:
        return "Example Accelerator (CPU stand-in)"

    def get_attention_backend_priority(self) -> list[str]:
        # sdpa comes from pagedllm-example-attention; when it is not installed
        # "auto" records "not registered by any plugin" and takes torch_native.
        return ["sdpa", "torch_native"]

    def get_device_communicator(
        self, group: torch.distributed.ProcessGroup, device: torch.device
    ) -> ExampleCommunicator:
        # Plugin API 1.3 calls this for each group of two or more ranks; the
        # import waits until then, so the plugin still loads on pagedllm 1.0-1.2.
        from pagedllm_example_platform.communicator import ExampleCommunicator

        return ExampleCommunicator(group, device)
