"""The CPU platform: always available, torch-native attention."""

from __future__ import annotations

import os
import platform as pyplatform

import torch

from pagedllm.platforms.interface import Platform


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def get_device_name(self) -> str:
        return pyplatform.processor() or pyplatform.machine() or "cpu"

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def get_attention_backend_priority(self) -> list[str]:
        return ["torch_native"]

    def total_memory_bytes(self) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

    def free_memory_bytes(self) -> int:
        # MemAvailable counts reclaimable page cache, which is what we can really use.
        try:
            with open("/proc/meminfo") as meminfo:
                for line in meminfo:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
