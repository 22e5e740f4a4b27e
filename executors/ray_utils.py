"""The `ray` executor's pieces that run on a rank or answer from Ray's
numbers alone (vLLM's `ray_utils`): the rank actor, where it runs, whether a
placement can fit, local ranks, and the words for a lost actor."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping, Sequence

import msgspec
import ray
from ray.exceptions import RayActorError

from pagedllm.core.errors import ConfigError
from pagedllm.executors.messages import encoder
from pagedllm.executors.worker_host import WorkerHost

# How long a cluster's head address may take to accept a connection.
CONNECT_TIMEOUT_S = 10.0


class RankPlacement(msgspec.Struct, array_like=True):
    """Where one rank's actor runs, as it reports it."""

    node_id: str
    node_ip: str
    pid: int
    gpu_ids: list[str]
    # A TCP port that was free on node_ip a moment ago (rank 0's is the rendezvous).
    free_port: int


placement_decoder = msgspec.msgpack.Decoder(RankPlacement)


class RankActor:
    """One rank: a WorkerHost behind a Ray actor. Every method takes and
    returns bytes (msgspec frames) or nothing."""

    def __init__(self) -> None:
        self.host = WorkerHost()

    def describe(self) -> bytes:
        node_ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in node_ip else socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((node_ip, 0))
            free_port = int(sock.getsockname()[1])
        return encoder.encode(RankPlacement(
            ray.get_runtime_context().get_node_id(), node_ip, os.getpid(),
            [str(gpu_id) for gpu_id in ray.get_gpu_ids()], free_port,
        ))

    def set_visible_devices(self, devices: bytes) -> None:
        # NOTE: before the Worker exists: CUDA reads it when first used.
        os.environ["CUDA_VISIBLE_DEVICES"] = devices.decode()

    def handle(self, frame: bytes) -> bytes | None:
        return self.host.handle(frame)


def placement_fits(nodes: Sequence[Mapping[str, float]], bundle: Mapping[str, float], num_bundles: int,
                   strategy: str) -> bool:
    """Whether nodes with these total resources can ever hold `num_bundles`
    copies of `bundle` under `strategy` (busy or not)."""
    per_node = [min(int(resources.get(key, 0.0) // amount) for key, amount in bundle.items()) for resources in nodes]
    if strategy == "STRICT_PACK":
        return max(per_node, default=0) >= num_bundles
    return sum(per_node) >= num_bundles


def assign_local_ranks(placements: Sequence[RankPlacement]) -> tuple[list[int], dict[str, list[str]]]:
    """Each rank's local rank, and each node's visible GPUs (sorted; empty on CPU).

    A rank's local rank indexes its node's visible GPUs (its own GPU's place
    among them); on CPU it is the rank's place among its node's ranks.
    """
    node_gpus: dict[str, list[str]] = {}
    for placement in placements:
        node_gpus.setdefault(placement.node_id, []).extend(placement.gpu_ids)
    for gpu_ids in node_gpus.values():
        gpu_ids.sort(key=lambda gpu_id: (len(gpu_id), gpu_id))
    local_ranks: list[int] = []
    seen_per_node: dict[str, int] = {}
    for placement in placements:
        if placement.gpu_ids:
            local_ranks.append(node_gpus[placement.node_id].index(placement.gpu_ids[0]))
        else:
            local_ranks.append(seen_per_node.get(placement.node_id, 0))
        seen_per_node[placement.node_id] = seen_per_node.get(placement.node_id, 0) + 1
    return local_ranks, node_gpus


def check_reachable(key: str, address: str) -> None:
    """A ConfigError now if nothing listens at a ``host:port`` address (Ray's
    own connect retries for minutes); other forms (``auto``, ``ray://``) are left to Ray."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise ConfigError(key, address, f"the address of a running Ray cluster's head (`ray start --head` "
                                        f"prints it); connecting failed: {exc}") from exc


def describe_actor_loss(exc: RayActorError) -> str:
    """The sentence of Ray's message that says why the actor is gone."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip() and not line.startswith("\t")]
    reasons = [line for line in lines if line != type(exc).BASE_ERROR_MSG] or lines
    return f"Ray actor lost: {reasons[0] if reasons else type(exc).__name__}"
