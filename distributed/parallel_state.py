"""The process groups of this process (vLLM's ``parallel_state``).

Order of calls in a worker: `init_distributed_environment` (the world:
every rank of the engine), then `initialize_model_parallel` (the tensor
parallel groups carved from it); `destroy_model_parallel` and
`destroy_distributed_environment` undo them. Model code asks
`get_tp_group()` for its collectives and works unchanged in a world of one,
where nothing needs initializing.

Expert parallelism (`parallel.enable_expert_parallel`): the expert-parallel
group has the tensor parallel group's ranks (vLLM's EP size with
data_parallel_size 1), as its own process group so that its all-to-alls
are counted apart from the tensor-parallel all-reduces; `get_ep_group()`
is None while expert parallelism is off.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pagedllm.core.errors import ConfigError
from pagedllm.distributed.group_coordinator import GroupCoordinator

if TYPE_CHECKING:
    from pagedllm.platforms.interface import Platform

# Uninitialized, get_tp_group() answers this group of one.
_SINGLE_PROCESS_TP = GroupCoordinator.single_process("tp")
_TP: GroupCoordinator | None = None
_EP: GroupCoordinator | None = None
# This rank's device index on its machine (cuda:<local_rank>), set with the world.
_LOCAL_RANK = 0


def init_distributed_environment(
    world_size: int,
    rank: int,
    distributed_init_method: str,
    backend: str,
    local_rank: int = 0,
) -> None:
    """Join (or create) the world process group: `world_size` ranks that
    meet at `distributed_init_method` (``tcp://127.0.0.1:PORT``). Called
    again in a process whose world is already this one, it does nothing."""
    global _LOCAL_RANK
    if world_size < 1:
        raise ConfigError("world_size", world_size, "1 or more")
    if not 0 <= rank < world_size:
        raise ConfigError("rank", rank, f"0 to {world_size - 1} (world_size={world_size})")
    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (world_size, rank):
            raise ConfigError(
                "world_size",
                world_size,
                f"the process group already running here: world size {dist.get_world_size()}, rank {dist.get_rank()}",
            )
    else:
        dist.init_process_group(
            backend=backend, init_method=distributed_init_method, world_size=world_size, rank=rank
        )
    _LOCAL_RANK = local_rank


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    backend: str | None = None,
    platform: Platform | None = None,
    enable_expert_parallel: bool = False,
) -> None:
    """Carve the tensor parallel groups out of the world (and with
    `enable_expert_parallel` the expert-parallel groups over the same
    ranks). Every rank calls it.

    `backend` defaults to the world's; `platform` (whose communicator the
    groups use) to ``resolve_platform("auto")``; a worker passes its own.
    """
    global _TP, _EP
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel needs init_distributed_environment first")
    world_size = dist.get_world_size()
    if _TP is not None:
        if _TP.world_size != tensor_model_parallel_size:
            raise ConfigError(
                "tensor_parallel_size", tensor_model_parallel_size, f"{_TP.world_size}, the size already initialized"
            )
        return
    # NOTE: the world is the TP group for now; a data-parallel dimension will
    # make the world a multiple of it, each block of ranks one TP group.
    if tensor_model_parallel_size != world_size:
        raise ConfigError(
            "tensor_parallel_size",
            tensor_model_parallel_size,
            f"the world size, {world_size} (no other parallel dimension yet)",
        )
    if platform is None:
        from pagedllm.platforms import resolve_platform

        platform = resolve_platform("auto")
    group_ranks = [
        list(range(start, start + tensor_model_parallel_size))
        for start in range(0, world_size, tensor_model_parallel_size)
    ]
    _TP = _new_group_coordinator(group_ranks, backend or dist.get_backend(), platform, "tp")
    if enable_expert_parallel and tensor_model_parallel_size > 1:
        _EP = _new_group_coordinator(group_ranks, backend or dist.get_backend(), platform, "ep")


def _new_group_coordinator(
    group_ranks: list[list[int]], backend: str, platform: Platform, group_name: str
) -> GroupCoordinator:
    """This rank's group among `group_ranks` (disjoint rank lists)."""
    rank = dist.get_rank()
    mine: tuple[list[int], dist.ProcessGroup] | None = None
    for ranks in group_ranks:
        # NOTE: new_group is collective over the whole world: every rank
        # creates every group, in the same order, members or not.
        group = dist.new_group(ranks, backend=backend)
        if rank in ranks:
            mine = (ranks, group)
    if mine is None:
        raise ValueError(f"rank {rank} is in none of the {group_name} groups {group_ranks}")
    ranks, group = mine
    if len(ranks) == 1:
        return GroupCoordinator(ranks, rank, group, None, group_name)
    device = torch.device("cpu") if platform.device_type == "cpu" else torch.device(platform.device_type, _LOCAL_RANK)
    return GroupCoordinator(ranks, rank, group, platform.get_device_communicator(group, device), group_name)


def get_tp_group() -> GroupCoordinator:
    """The tensor parallel group of this rank; a group of one (identity
    collectives) while model parallelism is not initialized."""
    return _TP if _TP is not None else _SINGLE_PROCESS_TP


def get_ep_group() -> GroupCoordinator | None:
    """The expert-parallel group of this rank (the tensor parallel group's
    ranks); None when expert parallelism is off or there is one rank."""
    return _EP


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def destroy_model_parallel() -> None:
    """Drop the tensor (and expert) parallel groups; get_tp_group() is a
    group of one again."""
    global _TP, _EP
    for group in (_EP, _TP):
        if group is not None:
            group.destroy()
    _TP = _EP = None


def destroy_distributed_environment() -> None:
    """Leave the world (model parallel groups first); safe to call twice."""
    global _LOCAL_RANK
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _LOCAL_RANK = 0
