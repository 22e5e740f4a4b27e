"""Where a rank runs on its host (issue 16 point 1): the ranks of every
data-parallel engine on the host are numbered together (`-dp 2 -tp 2`:
replica 1 holds ranks 2 and 3), and the platform places each: on CPU a
disjoint run of cores with one torch thread per core, on CUDA its own GPU.
The system calls are patched: nothing here pins the test process."""

from __future__ import annotations

import os

import pytest
import torch

from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cuda import CudaPlatform
from pagedllm.platforms.interface import cores_for_rank
from pagedllm.worker.worker import rank_on_host


@pytest.mark.parametrize(("num_cores", "num_ranks", "expected"), [
    (8, 4, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (7, 3, [[0, 1, 2], [3, 4], [5, 6]]),  # the first ranks take the remainder
    (2, 2, [[0], [1]]),
    (2, 4, [[0], [1], [0], [1]]),  # fewer cores than ranks: shared in turn
    (4, 1, [[0, 1, 2, 3]]),
])
def test_each_rank_gets_a_contiguous_share_of_the_cores(
    num_cores: int, num_ranks: int, expected: list[list[int]]
) -> None:
    cores = [10 + core for core in range(num_cores)]  # the process's cores need not start at 0
    shares = [cores_for_rank(cores, rank, num_ranks) for rank in range(num_ranks)]
    assert shares == [[10 + core for core in share] for share in expected]


def test_replicas_number_their_ranks_together_on_the_host() -> None:
    parallel = EngineConfig.from_flat(data_parallel_size=2, data_parallel_rank=1, tensor_parallel_size=2).parallel
    assert [rank_on_host(parallel, local_rank) for local_rank in (0, 1)] == [(2, 4), (3, 4)]
    assert rank_on_host(EngineConfig().parallel, 0) == (0, 1)


def _pinning(monkeypatch: pytest.MonkeyPatch, cores: set[int]) -> list[tuple[object, ...]]:
    calls: list[tuple[object, ...]] = []
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, mask: calls.append(("affinity", pid, sorted(mask))))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: calls.append(("threads", n)))
    return calls


def test_a_cpu_rank_is_pinned_to_its_cores_with_a_thread_each(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _pinning(monkeypatch, {0, 1, 2, 3, 4, 5})
    CpuPlatform().init_rank(2, 4)  # replica 1's first rank of -dp 2 -tp 2
    assert calls == [("affinity", 0, [4]), ("threads", 1)]
    calls.clear()
    CpuPlatform().init_rank(0, 2)
    assert calls == [("affinity", 0, [0, 1, 2]), ("threads", 3)]


def test_omp_num_threads_means_the_operator_placed_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _pinning(monkeypatch, {0, 1})
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    CpuPlatform().init_rank(1, 2)
    assert calls == []


def test_cuda_ranks_get_disjoint_gpus_and_too_many_ranks_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    chosen: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    platform = CudaPlatform()
    for local_rank in range(4):
        platform.init_rank(local_rank, 4)
        assert platform.device() == torch.device("cuda", local_rank)
    assert chosen == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match=r"8 ranks on this host .* at most 4: one GPU per rank"):
        platform.init_rank(5, 8)
