"""The Platform interface: what the engine asks of a device kind."""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

from pagedllm.core.errors import ConfigError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


def cores_for_rank(cores: Sequence[int], local_rank: int, local_world_size: int) -> list[int]:
    """Rank `local_rank`'s share of `cores`: a contiguous run, the runs as
    even as the count allows (the first ranks take the remainder). With fewer
    cores than ranks, each rank gets one core and ranks share them in turn."""
    if len(cores) < local_world_size:
        return [cores[local_rank % len(cores)]]
    base, extra = divmod(len(cores), local_world_size)
    start = local_rank * base + min(local_rank, extra)
    return list(cores[start : start + base + (1 if local_rank < extra else 0)])


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


# cache.cache_dtype value -> the KV cache's storage dtype; "auto" is the
# compute dtype (attention_backends/kv_cache_dtype.py stores and reads it).
FP8_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,  # vLLM's "fp8" is E4M3
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
KV_CACHE_DTYPE_NAMES = ("auto", *FP8_CACHE_DTYPES)
FP8_DTYPES = frozenset(FP8_CACHE_DTYPES.values())


def resolve_kv_cache_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype the KV cache tensors are allocated in."""
    if cache_dtype == "auto":
        return model_dtype
    try:
        return FP8_CACHE_DTYPES[cache_dtype]
    except KeyError:
        raise ConfigError("cache.cache_dtype", cache_dtype, ", ".join(KV_CACHE_DTYPE_NAMES)) from None


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


class DeviceCommunicator(ABC):
    """The collectives of one process group on one device (vLLM's
    DeviceCommunicatorBase). A platform returns its own from
    `Platform.get_device_communicator` (a custom all-reduce kernel, a vendor
    collective library); `GroupCoordinator` calls it only when the group has
    more than one rank, so a world of one never reaches it.

    `dst` and `src` are ranks within the group, not global ranks; `input_`
    has the same shape on every rank.
    """

    def __init__(self, group: ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.ranks: list[int] = dist.get_process_group_ranks(group)
        self.world_size = len(self.ranks)
        self.rank_in_group = self.ranks.index(dist.get_rank())

    @abstractmethod
    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The element-wise sum over the group. May overwrite `input_`: use the result."""

    @abstractmethod
    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `input_` concatenated along `dim`, in rank order."""

    @abstractmethod
    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """As `all_gather` on rank `dst`; None on every other rank."""

    @abstractmethod
    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank `src`'s `input_` on every rank. May overwrite `input_`: use the result."""

    def all_to_all(
        self, input_: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int]
    ) -> torch.Tensor:
        """Rows `input_split_sizes[r]` of `input_` (consecutive, along dim 0)
        to rank r; returns the rows every rank sent here, in rank order
        (`output_split_sizes[r]` from rank r). Unlike the others, the shapes
        differ between ranks. The default is torch.distributed's
        all_to_all_single, which gloo (torch >= 2.x) and NCCL both run with
        uneven splits; a platform with a faster exchange overrides it."""
        input_ = input_.contiguous()
        output = input_.new_empty((sum(output_split_sizes), *input_.shape[1:]))
        dist.all_to_all_single(output, input_, output_split_sizes, input_split_sizes, group=self.group)
        return output

    def destroy(self) -> None:  # noqa: B027 (optional: the default holds nothing to release)
        """Release what the communicator holds (buffers, library handles)."""


class TorchDistributedCommunicator(DeviceCommunicator):
    """The collectives of torch.distributed over the group's own backend
    (gloo on CPU, nccl on CUDA): what a platform gets unless it brings its own."""

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(input_, group=self.group)
        return input_

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        # NOTE: list-form all_gather, not all_gather_into_tensor: gloo has only the former.
        input_ = input_.contiguous()
        outputs = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.all_gather(outputs, input_, group=self.group)
        return torch.cat(outputs, dim=dim)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        input_ = input_.contiguous()
        if self.rank_in_group != dst:
            dist.gather(input_, None, dst=self.ranks[dst], group=self.group)
            return None
        outputs = [torch.empty_like(input_) for _ in range(self.world_size)]
        dist.gather(input_, outputs, dst=self.ranks[dst], group=self.group)
        return torch.cat(outputs, dim=dim)

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        dist.broadcast(input_, src=self.ranks[src], group=self.group)
        return input_


class Platform(ABC):
    """One device kind. Instances are cheap; device queries happen on call."""

    name: ClassVar[str]
    device_type: ClassVar[str]  # "cpu" | "cuda" (a torch device type)
    # The torch.distributed backend its process groups use (plugin API 1.3).
    dist_backend: ClassVar[str] = "gloo"

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

    def init_rank(self, local_rank: int, local_world_size: int) -> None:
        """Make this process one of `local_world_size` ranks on this host
        (plugin API 1.3; a multi-rank executor's worker, or a data-parallel
        engine, calls it before it asks for `device()`). Default: the process
        is pinned to its own share of the cores (`cores_for_rank`) with one
        torch thread per core, unless OMP_NUM_THREADS says the operator placed
        the ranks already."""
        if "OMP_NUM_THREADS" in os.environ:
            return
        if not hasattr(os, "sched_setaffinity"):  # no pinning here: split the thread count only
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
            return
        share = cores_for_rank(sorted(os.sched_getaffinity(0)), local_rank, local_world_size)
        os.sched_setaffinity(0, share)
        torch.set_num_threads(len(share))

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

    def register_layer_ops(self, register: Callable[..., None]) -> None:  # noqa: B027 (optional)
        """Offer this device's implementations of the layers' ops (prepacked
        GEMMs, fused kernels) to the op registry a model is prepared with:
        ``register(op, name, build, priority=..., supports=...)``, where
        `build(layer)` returns the kernel the layer then calls
        (model_registry/layers/ops.py lists the ops and their kernels'
        signatures). Each layer asks once, before any forward. Must not
        change what the model computes beyond rounding. Default: nothing."""

    def optimize_model(self, model: torch.nn.Module) -> None:  # noqa: B027 (optional: the default does nothing)
        """Device-specific preparation of a loaded model whose ops are bound
        (process tuning, compilation). Must not change what the model
        computes beyond rounding. Default: nothing."""

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

    def explain_dtype(self, requested: str, model_dtype: torch.dtype) -> str:
        """Why `resolve_dtype(requested, model_dtype)` chose what it did, in
        words (`pagedllm env`, the engine's log)."""
        chosen = dtype_name(self.resolve_dtype(requested, model_dtype))
        if requested != "auto":
            return f"{requested}: asked for, runs in {chosen}"
        checkpoint = dtype_name(model_dtype)
        if chosen == checkpoint:
            return f"auto: the checkpoint's {checkpoint}, which {self.describe()} supports"
        return f"auto: a {checkpoint} checkpoint runs in {chosen} ({self.describe()} has no {checkpoint})"

    def supports_kv_cache_dtype(self, dtype: torch.dtype) -> bool:
        """Whether a KV cache can be stored in `dtype` here (a compute dtype
        always can). Default: torch converts a tensor on this device to
        `dtype` and back (float8 on the CPU and CUDA)."""
        if dtype in self.supported_dtypes():
            return True
        try:
            probe = torch.ones(2, device=self.device())
            return bool((probe.to(dtype).to(torch.float32) == probe).all())
        except (RuntimeError, TypeError, NotImplementedError):
            return False

    def resolve_kv_cache_dtype(self, requested: str, compute_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's storage dtype for `cache.cache_dtype` (``"auto"``:
        the compute dtype); a ConfigError naming `cache.cache_dtype` where
        this device cannot store it."""
        cache_dtype = resolve_kv_cache_dtype(requested, compute_dtype)
        if not self.supports_kv_cache_dtype(cache_dtype):
            raise ConfigError(
                "cache.cache_dtype",
                requested,
                f"auto: torch cannot store {dtype_name(cache_dtype)} on {self.describe()}",
            )
        return cache_dtype

    def get_device_communicator(self, group: ProcessGroup, device: torch.device) -> DeviceCommunicator:
        """The collectives of `group` on `device` (plugin API 1.3). Default:
        torch.distributed's own over the group's backend."""
        return TorchDistributedCommunicator(group, device)

    def describe_communicator(self) -> str:
        """``"gloo (torch.distributed)"``: the ranks' collectives, for READY and `pagedllm env`."""
        own = type(self).get_device_communicator is not Platform.get_device_communicator
        source = f"{type(self).__name__}'s own" if own else "torch.distributed"
        return f"{self.dist_backend} ({source})"

    def describe(self) -> str:
        """``"cuda (compute capability 7.5)"``: for error messages."""
        capability = self.get_device_capability()
        if capability is None:
            return self.name
        return f"{self.name} (compute capability {capability[0]}.{capability[1]})"

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
