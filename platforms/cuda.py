"""The CUDA platform.

NOTE: every device query goes through ``torch.cuda.<fn>`` looked up at call
time, so tests simulate a device by patching ``torch.cuda.is_available`` and
``torch.cuda.get_device_capability``.
"""

from __future__ import annotations

import torch

from pagedllm.platforms.interface import Platform


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"

    def __init__(self, device_index: int = 0) -> None:
        self.device_index = device_index

    @classmethod
    def is_available(cls) -> bool:
        return bool(torch.cuda.is_available())

    def get_device_name(self) -> str:
        try:
            return str(torch.cuda.get_device_name(self.device_index))
        except (RuntimeError, AssertionError):  # simulated device in tests, or a broken driver
            return f"cuda:{self.device_index}"

    def get_device_capability(self) -> tuple[int, int]:
        major, minor = torch.cuda.get_device_capability(self.device_index)
        return (int(major), int(minor))

    def supported_dtypes(self) -> list[torch.dtype]:
        # bfloat16 needs Ampere (8.0); Turing emulates nothing, it just fails.
        if self.get_device_capability() >= (8, 0):
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float16, torch.float32]

    def get_attention_backend_priority(self) -> list[str]:
        return ["flash_attn", "triton", "torch_native"]

    def total_memory_bytes(self) -> int:
        return int(torch.cuda.mem_get_info(self.device_index)[1])

    def free_memory_bytes(self) -> int:
        return int(torch.cuda.mem_get_info(self.device_index)[0])

    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)
