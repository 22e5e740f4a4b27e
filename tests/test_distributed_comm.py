"""Process groups and their collectives: two gloo ranks on 127.0.0.1 checked
against hand-computed results, the world of one that needs no init, and the
platform's part (its backend, its communicator)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

from pagedllm.core.errors import ConfigError
from pagedllm.distributed import (
    destroy_distributed_environment,
    get_distributed_init_method,
    get_open_port,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
)
from pagedllm.platforms import resolve_platform
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.interface import Platform, TorchDistributedCommunicator

WORLD_SIZE = 2
CHILD_TIMEOUT_S = 60

# One rank of the pair: every check runs in the same two processes (one
# start-up each), the results travel back through torch.save.
RANK_SCRIPT = """
import sys

import torch
import torch.distributed as dist

torch.set_num_threads(1)

from pagedllm.distributed import (
    destroy_distributed_environment, destroy_model_parallel, get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size, get_tp_group, init_distributed_environment,
    initialize_model_parallel, model_parallel_is_initialized,
)
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.interface import TorchDistributedCommunicator


class CountingCommunicator(TorchDistributedCommunicator):
    def __init__(self, group, device):
        super().__init__(group, device)
        self.calls = []

    def all_reduce(self, input_):
        self.calls.append("all_reduce")
        return super().all_reduce(input_)

    def all_gather(self, input_, dim=-1):
        self.calls.append("all_gather")
        return super().all_gather(input_, dim)

    def gather(self, input_, dst=0, dim=-1):
        self.calls.append("gather")
        return super().gather(input_, dst, dim)

    def broadcast(self, input_, src=0):
        self.calls.append("broadcast")
        return super().broadcast(input_, src)


class CountingPlatform(CpuPlatform):
    def get_device_communicator(self, group, device):
        return CountingCommunicator(group, device)


rank, world_size, init_method, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
init_distributed_environment(world_size, rank, init_method, CpuPlatform.dist_backend)
init_distributed_environment(world_size, rank, init_method, CpuPlatform.dist_backend)  # again: a no-op
initialize_model_parallel(world_size, platform=CountingPlatform())
tp = get_tp_group()
x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank * 10
reduced_input = x.clone()
results = {
    "tp_rank": get_tensor_model_parallel_rank(),
    "tp_world_size": get_tensor_model_parallel_world_size(),
    "ranks": tp.ranks,
    "is_first_rank": tp.is_first_rank,
    "backend": dist.get_backend(tp.device_group),
    "all_reduce": tp.all_reduce(reduced_input),
    "int_all_reduce": tp.all_reduce(torch.tensor([rank + 1, 5 * rank], dtype=torch.int64)),
    "bf16_all_reduce": tp.all_reduce(torch.tensor([1.5, -2.25], dtype=torch.bfloat16) * (rank + 1)),
    "all_gather_dim0": tp.all_gather(x, dim=0),
    "all_gather_dim_last": tp.all_gather(x, dim=-1),
    "all_gather_transposed": tp.all_gather(x.t(), dim=1),
    "gather_to_0": tp.gather(x, dst=0),
    "gather_to_1_dim0": tp.gather(x, dst=1, dim=0),
    "broadcast_from_0": tp.broadcast(x.clone(), src=0),
    "broadcast_from_1": tp.broadcast(x.clone(), src=1),
    "calls": list(tp.device_communicator.calls),
}
results["num_collectives"], results["collective_seconds"] = tp.num_collectives, tp.collective_seconds
destroy_model_parallel()
results["after_destroy_model_parallel"] = (model_parallel_is_initialized(), get_tensor_model_parallel_world_size())
destroy_distributed_environment()
results["dist_initialized_after_destroy"] = dist.is_initialized()
torch.save(results, out)
"""


@pytest.fixture(scope="module")
def rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("tp2")
    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    logs = [folder / f"rank{rank}.log" for rank in range(WORLD_SIZE)]
    try:
        for rank in range(WORLD_SIZE):
            with open(logs[rank], "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", RANK_SCRIPT, str(rank), str(WORLD_SIZE), init_method,
                         str(folder / f"rank{rank}.pt")],
                        env=env, stdout=log, stderr=subprocess.STDOUT,
                    )
                )
        deadline = time.monotonic() + CHILD_TIMEOUT_S
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        # NOTE: a rank that failed leaves its peer blocked in a collective: kill, never orphan.
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for rank, proc in enumerate(procs):
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{logs[rank].read_text()}"
    return [torch.load(folder / f"rank{rank}.pt") for rank in range(WORLD_SIZE)]


def rank_input(rank: int) -> torch.Tensor:
    return torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank * 10


def test_two_ranks_form_one_tensor_parallel_group_over_gloo(rank_results: list[dict[str, Any]]) -> None:
    for rank, results in enumerate(rank_results):
        assert results["tp_rank"] == rank
        assert results["tp_world_size"] == WORLD_SIZE
        assert results["ranks"] == [0, 1]
        assert results["is_first_rank"] == (rank == 0)
        assert results["backend"] == "gloo"


def test_all_reduce_sums_over_the_ranks(rank_results: list[dict[str, Any]]) -> None:
    expected = rank_input(0) + rank_input(1)  # [[10, 12, 14], [16, 18, 20]]
    for results in rank_results:
        torch.testing.assert_close(results["all_reduce"], expected, rtol=0, atol=0)
        assert torch.equal(results["int_all_reduce"], torch.tensor([1 + 2, 0 + 5]))
        # bfloat16 models reduce in bfloat16 (gloo sums it; these values are exact)
        assert torch.equal(results["bf16_all_reduce"], torch.tensor([4.5, -6.75], dtype=torch.bfloat16))


def test_all_gather_concatenates_in_rank_order_along_the_dim(rank_results: list[dict[str, Any]]) -> None:
    for results in rank_results:
        assert torch.equal(results["all_gather_dim0"], torch.cat([rank_input(0), rank_input(1)], dim=0))
        assert torch.equal(
            results["all_gather_dim_last"],
            torch.tensor([[0.0, 1, 2, 10, 11, 12], [3, 4, 5, 13, 14, 15]]),
        )
        # a non-contiguous input gathers its values, not its storage order
        assert torch.equal(results["all_gather_transposed"], torch.cat([rank_input(0).t(), rank_input(1).t()], dim=1))


def test_gather_lands_on_the_destination_rank_only(rank_results: list[dict[str, Any]]) -> None:
    rank0, rank1 = rank_results
    assert torch.equal(rank0["gather_to_0"], torch.cat([rank_input(0), rank_input(1)], dim=-1))
    assert rank1["gather_to_0"] is None
    assert rank0["gather_to_1_dim0"] is None
    assert torch.equal(rank1["gather_to_1_dim0"], torch.cat([rank_input(0), rank_input(1)], dim=0))


def test_broadcast_copies_the_source_rank_everywhere(rank_results: list[dict[str, Any]]) -> None:
    for results in rank_results:
        assert torch.equal(results["broadcast_from_0"], rank_input(0))
        assert torch.equal(results["broadcast_from_1"], rank_input(1))


def test_the_platforms_communicator_carries_every_collective(rank_results: list[dict[str, Any]]) -> None:
    expected_calls = ["all_reduce"] * 3 + ["all_gather"] * 3 + ["gather"] * 2 + ["broadcast"] * 2
    for results in rank_results:
        assert results["calls"] == expected_calls


def test_the_group_counts_its_collectives_and_their_time(rank_results: list[dict[str, Any]]) -> None:
    for results in rank_results:
        assert results["num_collectives"] == len(results["calls"])
        assert results["collective_seconds"] > 0.0


def test_destroy_leaves_a_world_of_one(rank_results: list[dict[str, Any]]) -> None:
    for results in rank_results:
        assert results["after_destroy_model_parallel"] == (False, 1)
        assert results["dist_initialized_after_destroy"] is False


def test_init_method_names_a_tcp_rendezvous() -> None:
    assert get_distributed_init_method("127.0.0.1", 29500) == "tcp://127.0.0.1:29500"
    assert get_distributed_init_method("::1", 29500) == "tcp://[::1]:29500"
    assert 0 < get_open_port() < 65536


# ------------------------------------------------------------- a world of one


def test_uninitialized_tp_group_is_one_rank_whose_collectives_return_their_input() -> None:
    assert not dist.is_initialized()
    assert not model_parallel_is_initialized()
    tp = get_tp_group()
    assert (tp.world_size, tp.rank_in_group, tp.ranks, tp.is_first_rank) == (1, 0, [0], True)
    assert (get_tensor_model_parallel_world_size(), get_tensor_model_parallel_rank()) == (1, 0)
    assert tp.device_group is None and tp.device_communicator is None
    x = torch.arange(6.0).reshape(2, 3)
    assert tp.all_reduce(x) is x
    assert tp.all_gather(x, dim=0) is x
    assert tp.gather(x) is x
    assert tp.broadcast(x) is x
    assert torch.equal(x, torch.arange(6.0).reshape(2, 3))


def test_collectives_refuse_a_rank_or_dim_the_group_does_not_have() -> None:
    tp = get_tp_group()
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="dst=1 is not a rank"):
        tp.gather(x, dst=1)
    with pytest.raises(ValueError, match="src=-1 is not a rank"):
        tp.broadcast(x, src=-1)
    with pytest.raises(ValueError, match="dim 2 is out of range"):
        tp.all_gather(x, dim=2)


@pytest.fixture
def world_of_one() -> Iterator[str]:
    init_method = get_distributed_init_method("127.0.0.1", get_open_port())
    try:
        yield init_method
    finally:
        destroy_distributed_environment()


def test_an_initialized_world_of_one_keeps_identity_collectives(world_of_one: str) -> None:
    init_distributed_environment(1, 0, world_of_one, "gloo")
    initialize_model_parallel(1, platform=CpuPlatform())
    initialize_model_parallel(1, platform=CpuPlatform())  # again: a no-op
    tp = get_tp_group()
    assert model_parallel_is_initialized()
    assert (tp.world_size, tp.ranks) == (1, [0])
    assert tp.device_group is not None and tp.device_communicator is None
    x = torch.ones(3)
    assert tp.all_reduce(x) is x
    destroy_distributed_environment()
    assert not dist.is_initialized()
    assert get_tp_group().device_group is None


def test_parallel_sizes_the_world_cannot_hold_are_config_errors(world_of_one: str) -> None:
    with pytest.raises(RuntimeError, match="init_distributed_environment first"):
        initialize_model_parallel(1, platform=CpuPlatform())
    with pytest.raises(ConfigError, match="rank=1 is invalid"):
        init_distributed_environment(1, 1, world_of_one, "gloo")
    with pytest.raises(ConfigError, match="world_size=0 is invalid"):
        init_distributed_environment(0, 0, world_of_one, "gloo")
    init_distributed_environment(1, 0, world_of_one, "gloo")
    with pytest.raises(ConfigError, match="already running here: world size 1, rank 0"):
        init_distributed_environment(2, 0, world_of_one, "gloo")
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 is invalid; allowed: the world size, 1"):
        initialize_model_parallel(2, platform=CpuPlatform())
    initialize_model_parallel(1, platform=CpuPlatform())
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 is invalid; allowed: 1, the size already"):
        initialize_model_parallel(2, platform=CpuPlatform())


# ------------------------------------------------------------- the platform's part


class PlatformOfApi10(Platform):
    """A platform written against plugin API 1.0: nothing distributed defined."""

    name = "api10"
    device_type = "cpu"

    @classmethod
    def is_available(cls) -> bool:
        return True

    def get_device_name(self) -> str:
        return "api10"

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float32]

    def get_attention_backend_priority(self) -> list[str]:
        return ["torch_native"]

    def total_memory_bytes(self) -> int:
        return 1

    def free_memory_bytes(self) -> int:
        return 1


def test_cpu_groups_use_gloo_and_cuda_groups_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CpuPlatform.dist_backend == "gloo"
    assert resolve_platform("cpu").dist_backend == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    cuda = resolve_platform("auto")
    assert (cuda.name, cuda.dist_backend) == ("cuda", "nccl")


def test_a_platform_of_api_10_gets_gloo_and_the_torch_distributed_communicator(world_of_one: str) -> None:
    platform = PlatformOfApi10()
    assert platform.dist_backend == "gloo"
    init_distributed_environment(1, 0, world_of_one, platform.dist_backend)
    group = dist.new_group([0])
    communicator = platform.get_device_communicator(group, platform.device())
    assert type(communicator) is TorchDistributedCommunicator
    assert (communicator.ranks, communicator.world_size, communicator.rank_in_group) == ([0], 1, 0)
    assert communicator.device == torch.device("cpu")
    # a group of one through torch.distributed itself: the input comes back
    x = torch.arange(4.0)
    assert torch.equal(communicator.all_reduce(x.clone()), x)
    assert torch.equal(communicator.all_gather(x.reshape(2, 2), dim=0), x.reshape(2, 2))
    gathered = communicator.gather(x, dst=0)
    assert gathered is not None and torch.equal(gathered, x)
    assert torch.equal(communicator.broadcast(x.clone(), src=0), x)
