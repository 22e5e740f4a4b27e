"""A stand-in vendor accelerator: the CPU, gated by an env var, with its own
attention backend priority."""

from __future__ import annotations

import os

from pagedllm.platforms.cpu import CpuPlatform
from pagedllm_example_platform import ENABLE_ENV, PLATFORM_NAME


class ExampleAcceleratorPlatform(CpuPlatform):
    name = PLATFORM_NAME
    device_type = "cpu"  # a torch device type; a real vendor has its own (e.g. "xpu")

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
