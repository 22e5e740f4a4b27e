"""pagedllm-example-platform: registers the ``example_accel`` platform.

A real vendor plugin would probe its driver in ``is_available``; this one
stands in for such an accelerator on the CPU and is available only when
``PAGEDLLM_EXAMPLE_PLATFORM=1``. With ``device.platform: auto`` an available
out-of-tree platform wins over pagedllm's built-in cpu/cuda.
"""

from __future__ import annotations

from pagedllm.plugins import RegisterFn, hookimpl

# The plugin API range this plugin was written for (pagedllm.plugins.API_VERSION).
PAGEDLLM_API_VERSION = ">=1.0,<2"

PLATFORM_NAME = "example_accel"
ENABLE_ENV = "PAGEDLLM_EXAMPLE_PLATFORM"


@hookimpl
def register_platforms(register: RegisterFn) -> None:
    register(PLATFORM_NAME, "pagedllm_example_platform.platform:ExampleAcceleratorPlatform", device_type="cpu")
