"""One process group seen from one rank, with its collectives (vLLM's
GroupCoordinator)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

    from pagedllm.platforms.interface import DeviceCommunicator

_T = TypeVar("_T")


class GroupCoordinator:
    """The ranks of one group, this process's place among them, and the
    collectives over them.

    A group of one rank never reaches a communicator: every collective
    returns its input, so single-process code pays nothing for calling them.
    Larger groups delegate to the platform's `DeviceCommunicator` and count
    their collectives and the wall time spent in them (waiting for the
    slowest rank included: what tensor parallelism costs a step).
    """

    def __init__(
        self,
        ranks: Sequence[int],
        rank: int,
        device_group: ProcessGroup | None,
        device_communicator: DeviceCommunicator | None,
        group_name: str,
    ) -> None:
        if len(ranks) > 1 and (device_group is None or device_communicator is None):
            raise ValueError(f"group {group_name!r} of {len(ranks)} ranks needs a process group and a communicator")
        self.group_name = group_name
        self.ranks = list(ranks)  # global ranks, in group order
        self.rank = rank  # this process's global rank
        self.rank_in_group = self.ranks.index(rank)
        self.world_size = len(self.ranks)
        self.device_group = device_group
        self.device_communicator = device_communicator
        self.num_collectives = 0
        self.collective_seconds = 0.0

    @classmethod
    def single_process(cls, group_name: str) -> GroupCoordinator:
        """The group of this process alone: what a world of one has."""
        return cls([0], 0, None, None, group_name)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    @property
    def is_last_rank(self) -> bool:
        return self.rank_in_group == self.world_size - 1

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        """The sum over the group. May overwrite `input_`: use the result."""
        if self.world_size == 1:
            return input_
        start = time.perf_counter()
        output = self._communicator().all_reduce(input_)
        return self._counted(start, output)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `input_` concatenated along `dim`, in rank order."""
        if not -input_.dim() <= dim < input_.dim():
            raise ValueError(f"dim {dim} is out of range for a {input_.dim()}-d tensor")
        if self.world_size == 1:
            return input_
        start = time.perf_counter()
        output = self._communicator().all_gather(input_, dim)
        return self._counted(start, output)

    def all_to_all(
        self, input_: torch.Tensor, output_split_sizes: list[int], input_split_sizes: list[int]
    ) -> torch.Tensor:
        """Each rank's rows to each rank: `input_split_sizes[r]` consecutive
        rows (dim 0) of `input_` go to rank-in-group r, and the result holds
        `output_split_sizes[r]` rows from each rank r, in rank order. The
        split sizes must agree across ranks (what r sends here is what this
        rank expects from r)."""
        if len(output_split_sizes) != self.world_size or len(input_split_sizes) != self.world_size:
            raise ValueError(f"all_to_all needs {self.world_size} split sizes each, got "
                             f"{len(output_split_sizes)} and {len(input_split_sizes)}")
        if self.world_size == 1:
            return input_
        start = time.perf_counter()
        output = self._communicator().all_to_all(input_, output_split_sizes, input_split_sizes)
        return self._counted(start, output)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        """`all_gather` on rank-in-group `dst`; None on the other ranks."""
        self._check_rank_in_group("dst", dst)
        if not -input_.dim() <= dim < input_.dim():
            raise ValueError(f"dim {dim} is out of range for a {input_.dim()}-d tensor")
        if self.world_size == 1:
            return input_
        start = time.perf_counter()
        gathered = self._communicator().gather(input_, dst, dim)
        self._counted(start, None)
        return gathered

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank-in-group `src`'s `input_` on every rank. May overwrite `input_`: use the result."""
        self._check_rank_in_group("src", src)
        if self.world_size == 1:
            return input_
        start = time.perf_counter()
        output = self._communicator().broadcast(input_, src)
        return self._counted(start, output)

    def destroy(self) -> None:
        if self.device_communicator is not None:
            self.device_communicator.destroy()
            self.device_communicator = None
        if self.device_group is not None:
            dist.destroy_process_group(self.device_group)
            self.device_group = None

    def _counted(self, start: float, output: _T) -> _T:
        # NOTE: a device communicator may return before the device finishes
        # (NCCL is asynchronous): there this counts the launch, not the transfer.
        self.collective_seconds += time.perf_counter() - start
        self.num_collectives += 1
        return output

    def _communicator(self) -> DeviceCommunicator:
        if self.device_communicator is None:
            raise RuntimeError(f"group {self.group_name!r} was destroyed")
        return self.device_communicator

    def _check_rank_in_group(self, name: str, value: int) -> None:
        if not 0 <= value < self.world_size:
            raise ValueError(f"{name}={value} is not a rank of group {self.group_name!r} (0 to {self.world_size - 1})")

    def __repr__(self) -> str:
        return f"GroupCoordinator({self.group_name!r}, ranks={self.ranks}, rank_in_group={self.rank_in_group})"
