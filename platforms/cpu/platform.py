"""The CPU platform: always available, the `cpu` attention backend."""

from __future__ import annotations

import ctypes
import logging
import os
import platform as pyplatform
from collections.abc import Callable

import torch

from pagedllm.platforms.interface import Platform, dtype_name

logger = logging.getLogger(__name__)

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling on 64-bit

# CPU flags that mean bfloat16 arithmetic in hardware: x86's AMX tiles and
# AVX-512 BF16 (/proc/cpuinfo "flags"), Arm's BF16 and SVE BF16 ("Features").
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16", "bf16", "svebf16")
# Checkpoints that "auto" runs in bfloat16 on such a CPU.
HALF_DTYPES = (torch.bfloat16, torch.float16)


def read_cpu_flags() -> set[str]:
    """The first CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                name, _, value = line.partition(":")
                if name.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


# Without an explicit size the CPU pool gets this much memory (vLLM's CPU
# backend reserves a fixed KV space the same way: VLLM_CPU_KVCACHE_SPACE).
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


def keep_freed_memory_in_process() -> bool:
    """Stop glibc from handing every freed activation buffer back to the OS.

    By default a buffer over 128 KiB is mmap'ed and munmap'ed on free, so each
    2 MB intermediate of a prefill page-faults its memory in again: elementwise
    ops slowed to a crawl and a prefill step took about twice as long. vLLM's CPU
    backend asks for tcmalloc for the same reason; mallopt gets most of the
    gain without an LD_PRELOAD. A no-op off glibc.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) == 1
        ok &= libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30) == 1
    except (OSError, AttributeError):
        return False
    return bool(ok)


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def get_device_name(self) -> str:
        return pyplatform.processor() or pyplatform.machine() or "cpu"

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    def native_bf16_flags(self) -> list[str]:
        """This CPU's flags that compute bfloat16 in hardware ([] = none: it would be emulated)."""
        flags = read_cpu_flags()
        return [flag for flag in NATIVE_BF16_FLAGS if flag in flags]

    def resolve_dtype(self, requested: str, model_dtype: torch.dtype) -> torch.dtype:
        """``"auto"`` (vLLM's CPU rule): a bfloat16 or float16 checkpoint runs
        in bfloat16 where the CPU computes it natively (AMX, AVX-512 BF16,
        Arm BF16), everything else in float32 (float16 has no fast CPU path;
        emulated bfloat16 is slower than float32). An explicit dtype is kept."""
        if requested != "auto":
            return super().resolve_dtype(requested, model_dtype)
        return torch.bfloat16 if model_dtype in HALF_DTYPES and self.native_bf16_flags() else torch.float32

    def explain_dtype(self, requested: str, model_dtype: torch.dtype) -> str:
        if requested != "auto":
            return super().explain_dtype(requested, model_dtype)
        checkpoint = dtype_name(model_dtype)
        if model_dtype not in HALF_DTYPES:
            return f"auto: a {checkpoint} checkpoint runs in float32"
        if self.resolve_dtype(requested, model_dtype) == torch.bfloat16:
            return (f"auto: a {checkpoint} checkpoint runs in bfloat16, which this CPU computes natively "
                    f"({', '.join(self.native_bf16_flags())})")
        return (f"auto: a {checkpoint} checkpoint runs in float32: this CPU has no native bfloat16 "
                f"(none of {', '.join(NATIVE_BF16_FLAGS)})")

    def get_attention_backend_priority(self) -> list[str]:
        return ["cpu"]

    def kv_cache_budget_bytes(self, utilization: float, profile_run: Callable[[], None]) -> int:
        # Host memory is shared with everything else: a fixed space, not a
        # fraction of what happens to be free.
        return DEFAULT_CPU_KV_CACHE_BYTES

    def supports_graph_capture(self) -> bool:
        # A collective is a call into torch.distributed that a CPU graph does
        # not replay: with tensor parallelism every step runs eagerly.
        from pagedllm.distributed.parallel_state import get_tp_group

        return get_tp_group().world_size == 1

    def capture_graph(
        self, run: Callable[[], torch.Tensor], pool: object | None
    ) -> tuple[Callable[[], None], torch.Tensor, object]:
        """A CpuGraph (graph.py): the forward's kernels and ATen operations
        replayed without the Python around them."""
        from pagedllm.platforms.cpu.graph import CpuGraph

        graph = CpuGraph.capture(run)
        assert graph.output is not None
        logger.debug("CPU graph of batch %d: %d operations, %.1f MiB of activations kept", graph.output.shape[0],
                     graph.num_steps, graph.activation_bytes / 2**20)
        return graph.replay, graph.output, pool

    def register_layer_ops(self, register: Callable[..., None]) -> None:
        """Prepacked oneDNN / MKL / AMX GEMMs for linear layers; fused C
        kernels for RMSNorm, SiLU * mul and rotary embedding; grouped GEMMs
        and a decode kernel for MoE experts; the LoRA shrink/expand grouped
        by adapter."""
        from pagedllm.platforms.cpu import fused_moe, fused_ops, linear, lora

        linear.register_ops(register)
        fused_ops.register_ops(register)
        fused_moe.register_ops(register)
        lora.register_ops(register)

    def optimize_model(self, model: torch.nn.Module) -> None:
        if not keep_freed_memory_in_process():
            logger.info("could not tune glibc malloc; large activations will be re-faulted")

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
