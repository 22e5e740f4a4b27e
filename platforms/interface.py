"""The Platform interface: what the engine asks of a device kind."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from pagedllm.core.errors import ConfigError

# Accepted spellings of --dtype (vLLM's, plus short forms).
DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the spelling used in backend metadata)."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPE_NAMES[name.lower()]
    except KeyError:
        raise ConfigError("dtype", name, "auto, " + ", ".join(DTYPE_NAMES)) from None


class Platform(ABC):
    """One device kind. Instances are cheap; device queries happen on call."""

    name: ClassVar[str]
    device_type: ClassVar[str]  # "cpu" | "cuda" (a torch device type)

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this process can run on the device at all."""

    @abstractmethod
    def get_device_name(self) -> str: ...

    def get_device_capability(self) -> tuple[int, int] | None:
        """(major, minor) compute capability; None where the notion does not apply."""
        return None

    @abstractmethod
    def supported_dtypes(self) -> list[torch.dtype]: ...

    @abstractmethod
    def get_attention_backend_priority(self) -> list[str]:
        """Attention backend names, best first; ``"auto"`` takes the first that fits."""

    @abstractmethod
    def total_memory_bytes(self) -> int: ...

    @abstractmethod
    def free_memory_bytes(self) -> int: ...

    def device(self) -> torch.device:
        return torch.device(self.device_type)

    def kv_cache_budget_bytes(self, utilization: float, profile_run: Callable[[], None]) -> int:
        """Bytes the KV cache may take, the model already loaded.

        `profile_run` runs one forward of the largest batch the scheduler
        can send (on a throwaway cache); a device whose activations come out
        of the same memory measures its peak with it. Default: free memory
        x `utilization`, without profiling.
        """
        return int(self.free_memory_bytes() * utilization)

    def supports_graph_capture(self) -> bool:
        """Whether `capture_graph` works here (CUDA graphs and the like)."""
        return False

    def capture_graph(
        self, run: Callable[[], torch.Tensor], pool: object | None
    ) -> tuple[Callable[[], None], torch.Tensor, object]:
        """Record `run` once; returns (replay, its output tensor, the memory
        pool to share with the next capture). Replays re-read the inputs
        `run` read, in place."""
        raise NotImplementedError(f"{self.name} cannot capture graphs")

    def optimize_model(self, model: torch.nn.Module) -> None:  # noqa: B027 (optional: the default does nothing)
        """Device-specific preparation of a loaded model (weight prepacking,
        compilation). Must not change what the model computes beyond
        rounding. Default: nothing."""

    def resolve_dtype(self, requested: str, model_dtype: torch.dtype) -> torch.dtype:
        """The compute dtype: ``"auto"`` keeps the checkpoint's dtype when this
        device supports it, else falls back to float16, then float32; an
        explicit dtype this device cannot run is a ConfigError."""
        supported = self.supported_dtypes()
        if requested == "auto":
            for candidate in (model_dtype, torch.float16, torch.float32):
                if candidate in supported:
                    return candidate
            return supported[0]
        dtype = parse_dtype(requested)
        if dtype not in supported:
            raise ConfigError(
                "dtype",
                requested,
                f"{', '.join(dtype_name(d) for d in supported)} on {self.describe()}",
            )
        return dtype

    def describe(self) -> str:
        """``"cuda (compute capability 7.5)"``: for error messages."""
        capability = self.get_device_capability()
        if capability is None:
            return self.name
        return f"{self.name} (compute capability {capability[0]}.{capability[1]})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
