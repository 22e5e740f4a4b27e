"""Distributed state: the process groups of a multi-process engine and the
collectives over them (vLLM's ``vllm.distributed``).

Single-process code needs none of it initialized: `get_tp_group()` then
answers a group of one whose collectives return their input.
"""

from __future__ import annotations

from pagedllm.distributed.group_coordinator import GroupCoordinator
from pagedllm.distributed.parallel_state import (
    destroy_distributed_environment,
    destroy_model_parallel,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from pagedllm.distributed.utils import get_distributed_init_method, get_open_port

__all__ = [
    "GroupCoordinator",
    "destroy_distributed_environment",
    "destroy_model_parallel",
    "get_distributed_init_method",
    "get_open_port",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
]
