"""The CUDA platform.

NOTE: every device query goes through ``torch.cuda.<fn>`` looked up at call
time, so tests simulate a device by patching ``torch.cuda.is_available`` and
``torch.cuda.get_device_capability``.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable

import torch

from pagedllm.core.errors import ConfigError
from pagedllm.platforms.interface import Platform, is_fp8

logger = logging.getLogger(__name__)

# bfloat16 arithmetic needs Ampere.
BF16_MIN_CAPABILITY = (8, 0)
# The "fused_moe" op's name (model_registry/layers/ops.py), spelled here:
# a platform does not import the model layers.
FUSED_MOE = "fused_moe"
LORA = "lora"
TRITON_FUSED_MOE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TRITON_LORA_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_fused_moe_supports(layer: torch.nn.Module) -> bool:
    """A FusedMoE layer whose (unquantized) weights are CUDA tensors."""
    weight = getattr(layer, "w13_weight", None)
    return (isinstance(weight, torch.Tensor) and weight.is_cuda and weight.dtype in TRITON_FUSED_MOE_DTYPES
            and getattr(layer, "activation", None) in ("silu", "swigluoai"))


def _build_triton_fused_moe(layer: torch.nn.Module) -> Callable[..., torch.Tensor]:
    from pagedllm.platforms import cuda_fused_moe  # imports triton: only once a layer takes it

    return cuda_fused_moe.build(layer)


def triton_lora_supports(layer: torch.nn.Module) -> bool:
    """A LoRASlots layer whose slot buffers are contiguous CUDA tensors."""
    lora_a, lora_b = getattr(layer, "lora_a", None), getattr(layer, "lora_b", None)
    return (isinstance(lora_a, torch.Tensor) and isinstance(lora_b, torch.Tensor) and lora_a.is_cuda
            and lora_a.dtype in TRITON_LORA_DTYPES and lora_b.dtype == lora_a.dtype and lora_a.is_contiguous()
            and lora_b.is_contiguous() and hasattr(layer, "output_sizes") and hasattr(layer, "max_rank"))


def _build_triton_lora(layer: torch.nn.Module) -> Callable[..., None]:
    from pagedllm.platforms import cuda_lora  # imports triton: only once a layer takes it

    return cuda_lora.build(layer)


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"

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
        if self.get_device_capability() >= BF16_MIN_CAPABILITY:
            return [torch.bfloat16, torch.float16, torch.float32]
        return [torch.float16, torch.float32]

    def supports_kv_cache_dtype(self, dtype: torch.dtype) -> bool:
        """torch's CUDA build converts to and from float8 on every device it
        runs on (the attention backend's own limits are its registration's,
        e.g. Triton's E4M3 from 8.9). Answered without a tensor: a probe on
        the device would open a CUDA context on GPU 0 in every rank's
        process before the rank picks its own device."""
        return is_fp8(dtype) or dtype in self.supported_dtypes()

    def resolve_dtype(self, requested: str, model_dtype: torch.dtype) -> torch.dtype:
        """As the base rule; a bfloat16 checkpoint under "auto" below 8.0
        runs in float16, with a warning (asking for bfloat16 by name there is
        a ConfigError)."""
        dtype = super().resolve_dtype(requested, model_dtype)
        if requested == "auto" and model_dtype == torch.bfloat16 and dtype != torch.bfloat16:
            logger.warning(
                "%s cannot compute in bfloat16 (needs compute capability >= %d.%d); "
                "the bfloat16 checkpoint runs in %s. Set dtype to silence this.",
                self.describe(), *BF16_MIN_CAPABILITY, str(dtype).removeprefix("torch."),
            )
        return dtype

    def get_attention_backend_priority(self) -> list[str]:
        return ["flash_attn", "triton", "cpu"]

    def register_layer_ops(self, register: Callable[..., None]) -> None:
        """The Triton fused-MoE kernel (cuda_fused_moe.py) for MoE layers
        and the Triton LoRA shrink/expand (cuda_lora.py) for LoRA slots
        whose weights are on a CUDA device; without triton installed the
        layers keep their torch reference."""
        if importlib.util.find_spec("triton") is None:
            logger.info("triton is not installed: MoE and LoRA layers run their torch reference")
            return
        register(FUSED_MOE, "triton_fused_moe", _build_triton_fused_moe, supports=triton_fused_moe_supports)
        register(LORA, "triton_lora", _build_triton_lora, supports=triton_lora_supports)

    def total_memory_bytes(self) -> int:
        return int(torch.cuda.mem_get_info(self.device_index)[1])

    def free_memory_bytes(self) -> int:
        return int(torch.cuda.mem_get_info(self.device_index)[0])

    def kv_cache_budget_bytes(self, utilization: float, profile_run: Callable[[], None]) -> int:
        """free memory (weights already loaded) x utilization, minus the peak
        activation memory of a profiled forward of the largest batch."""
        torch.cuda.synchronize(self.device_index)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device_index)
        free_bytes = self.free_memory_bytes()
        allocated_before = torch.cuda.memory_allocated(self.device_index)
        profile_run()
        torch.cuda.synchronize(self.device_index)
        peak_bytes = torch.cuda.max_memory_allocated(self.device_index) - allocated_before
        torch.cuda.empty_cache()
        budget = int(free_bytes * utilization) - peak_bytes
        logger.info(
            "KV cache budget: %.2f GiB = %.2f GiB free x %.2f - %.2f GiB profiled activation peak",
            budget / 2**30, free_bytes / 2**30, utilization, peak_bytes / 2**30,
        )
        return budget

    def supports_graph_capture(self) -> bool:
        return True

    def capture_graph(
        self, run: Callable[[], torch.Tensor], pool: object | None
    ) -> tuple[Callable[[], None], torch.Tensor, object]:
        # Warm up outside the graph (lazy inits, Triton autotuning, cuBLAS handles).
        stream = torch.cuda.Stream(self.device_index)
        stream.wait_stream(torch.cuda.current_stream(self.device_index))
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device_index).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):  # type: ignore[arg-type]  # the interface keeps the pool opaque
            output = run()
        return graph.replay, output, graph.pool()

    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    def init_rank(self, local_rank: int, local_world_size: int) -> None:
        """Rank `local_rank` on this host runs on GPU `local_rank` (the ranks
        of every data-parallel engine on the host numbered together, so
        replicas get disjoint GPUs)."""
        num_devices = torch.cuda.device_count()
        if local_world_size > num_devices:
            raise ConfigError("parallel", f"{local_world_size} ranks on this host (data_parallel_size x "
                              "tensor_parallel_size)", f"at most {num_devices}: one GPU per rank")
        self.device_index = local_rank
        torch.cuda.set_device(local_rank)
