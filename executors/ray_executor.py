"""`ray`: one Ray actor per rank in a placement group (vLLM's `RayDistributedExecutor`).

The executor attaches to a Ray cluster (``parallel.ray_address``, else
``RAY_ADDRESS``) or, with neither, starts a small local one. It reserves a
placement group of ``tensor_parallel_size`` bundles (one CPU per rank, or one
GPU on CUDA) with ``parallel.placement_strategy``, and starts one `RankActor`
on each bundle. Rank 0's actor names the rendezvous (its node's IP and a free
port, or ``parallel.master_port``) where the ranks meet over torch.distributed
for the model's collectives.

As with `mp`, the executor sends every rank the same msgspec frames (one
step's scheduler output, or a utility call) and reads rank 0's step output:
the actors' methods take and return bytes, so nothing of ours is pickled.

Supervision: while it waits, the executor watches every call still pending on
any rank; an actor that is lost (killed, out of memory, its node gone) or
answers with an error makes the executor fail with a `RankFailedError` naming
the rank and the cause, and every later call fails the same way at once.
`shutdown` asks the ranks to stop, kills the actors, removes the placement
group and ends the Ray session it opened (a local Ray it started stops; a
cluster it attached to keeps running). Actors are not detached: if the
engine's process dies, Ray ends them with it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from pagedllm.core.errors import ConfigError
from pagedllm.distributed.utils import get_distributed_init_method
from pagedllm.executors.base import RankFailedError
from pagedllm.executors.messages import (
    CallWorker,
    InitWorker,
    encode_step,
    encoder,
    raise_reply_error,
    reply_decoder,
)
from pagedllm.executors.ray_utils import (
    RankActor,
    RankPlacement,
    assign_local_ranks,
    check_reachable,
    describe_actor_loss,
    placement_decoder,
    placement_fits,
)
from pagedllm.executors.remote_ranks import RemoteRanksExecutor
from pagedllm.executors.worker_host import OUTPUT_RANK

if TYPE_CHECKING:
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

# How often a waiting executor checks its deadline (an actor's loss wakes it at once).
POLL_S = 1.0
# Longest the cluster may take to reserve the placement group (nodes busy).
PLACEMENT_TIMEOUT_S = 120.0
# Longest a rank may take to start and join the others (imports, rendezvous).
START_TIMEOUT_S = 300.0
# Longest an idle health check may wait for every rank's answer.
HEALTH_TIMEOUT_S = 60.0
# When a rank answers with an error: how long the other ranks' actors get to
# show they are lost (Ray reports a dead actor within about a second).
LOSS_GRACE_S = 3.0
# On shutdown: how long ranks get to answer "shutdown" before their actors are killed.
STOP_GRACE_S = 5.0
# Object store of a local Ray this executor starts: frames are small.
LOCAL_OBJECT_STORE_BYTES = 100 * 1024 * 1024


class RayExecutor(RemoteRanksExecutor):
    def _init_executor(self) -> None:
        self._plan_ranks()
        self._actors: list[Any] = []
        self._placements: list[RankPlacement] = []
        self._placement_group: PlacementGroup | None = None
        # Calls sent but not yet answered: ref -> rank (the other ranks' step
        # replies stay here until they arrive, and are watched meanwhile).
        self._pending: dict[ray.ObjectRef[Any], int] = {}
        self._owns_ray_session = False
        self._shut_down = False
        try:
            self._connect()
            self._start_ranks()
            self.collective_rpc("load_model")
        except BaseException:
            self.shutdown()
            raise

    def _connect(self) -> None:
        if ray.is_initialized():
            return  # the caller's session (Ray's own driver, a notebook): left to it
        address = self.config.parallel.ray_address or os.environ.get("RAY_ADDRESS")
        if address:
            key = "parallel.ray_address" if self.config.parallel.ray_address else "RAY_ADDRESS"
            check_reachable(key, address)
            try:
                ray.init(address=address)
            except ConnectionError as exc:
                raise ConfigError(key, address, f"a Ray cluster this process can join ({exc}); one with token "
                                  "authentication also needs RAY_AUTH_MODE=token and its token (RAY_AUTH_TOKEN "
                                  "or ~/.ray/auth_token) here") from exc
        else:
            # "local": a new instance, even where `ray start` left a cluster Ray would find.
            ray.init(address="local", object_store_memory=LOCAL_OBJECT_STORE_BYTES, include_dashboard=False)
        self._owns_ray_session = True
        logger.info("ray executor: %s Ray at %s", "attached to" if address else "started a local",
                    ray.get_runtime_context().gcs_address)

    def _start_ranks(self) -> None:
        parallel = self.config.parallel
        bundle = {"GPU": 1.0} if self._platform.device_type == "cuda" else {"CPU": 1.0}
        self._placement_group = self._reserve(bundle, parallel.placement_strategy)
        actor_cls = ray.remote(RankActor)
        self._actors = [
            actor_cls.options(
                num_cpus=bundle.get("CPU", 0.0),
                num_gpus=bundle.get("GPU", 0.0),
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._placement_group, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(self.world_size)
        ]
        described = self._wait("describe", self._call_all("describe"), timeout_s=START_TIMEOUT_S, read=self._get)
        self._placements = [placement_decoder.decode(described[rank]) for rank in range(self.world_size)]
        local_ranks, node_gpus = assign_local_ranks(self._placements)
        for actor, placement in zip(self._actors, self._placements, strict=True):
            if placement.gpu_ids:
                actor.set_visible_devices.remote(",".join(node_gpus[placement.node_id]).encode())
        rank0 = self._placements[OUTPUT_RANK]
        init_method = get_distributed_init_method(rank0.node_ip, parallel.master_port or rank0.free_port)
        config_json = self.config.model_dump_json(exclude={"server"})
        logger.info("ray executor: %d ranks on nodes %s, rendezvous %s",
                    self.world_size, [placement.node_ip for placement in self._placements], init_method)
        refs = {
            actor.handle.remote(encoder.encode(
                InitWorker(config_json, rank, local_ranks[rank], self.world_size, init_method)
            )): rank
            for rank, actor in enumerate(self._actors)
        }
        self._wait("init", refs, timeout_s=START_TIMEOUT_S)

    def _reserve(self, bundle: dict[str, float], strategy: str) -> PlacementGroup:
        """A placement group of one `bundle` per rank, or a ConfigError saying what the cluster lacks."""
        nodes = [node["Resources"] for node in ray.nodes() if node["Alive"]]
        wanted = f"{self.world_size} bundles of {bundle} placed {strategy}"
        if not placement_fits(nodes, bundle, self.world_size, strategy):
            raise ConfigError("parallel.tensor_parallel_size", self.world_size,
                              f"what the Ray cluster can hold: {wanted}, but its nodes have "
                              f"{[{key: node.get(key, 0.0) for key in bundle} for node in nodes]}")
        group = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=strategy)
        ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
        if not ready:
            remove_placement_group(group)
            raise ConfigError("parallel.tensor_parallel_size", self.world_size,
                              f"what the Ray cluster has free: {wanted} not reserved in {PLACEMENT_TIMEOUT_S:.0f} s;"
                              f" free now: {ray.available_resources()}")
        return group

    # ------------------------------------------------------------- calls

    @property
    def rank_placements(self) -> list[RankPlacement]:
        """Where each rank's actor runs (node id and IP, process id, GPUs), in rank order."""
        return list(self._placements)

    def _call_all(self, method: str, *args: bytes) -> dict[ray.ObjectRef[Any], int]:
        self._raise_if_failed()
        return {getattr(actor, method).remote(*args): rank for rank, actor in enumerate(self._actors)}

    def _run_workers(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        if kwargs:
            raise TypeError(f"ray executor: {method} takes positional arguments only, got {sorted(kwargs)}")
        return self._run_all(method, args, timeout_s=None)

    def _run_all(self, method: str, args: Sequence[Any], timeout_s: float | None) -> list[Any]:
        frame = encoder.encode(CallWorker(method, list(args)))
        replies = self._wait(method, self._call_all("handle", frame), timeout_s=timeout_s)
        return [reply_decoder.decode(replies[rank]).value for rank in range(self.world_size)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        refs = self._call_all("handle", encode_step(scheduler_output))
        replies = self._wait("execute_model", refs, timeout_s=None, ranks=self._step_ranks)
        return self._step_output({rank: reply_decoder.decode(answer).output for rank, answer in replies.items()})

    def _wait(self, method: str, refs: dict[ray.ObjectRef[Any], int], timeout_s: float | None,
              ranks: set[int] | None = None, read: Callable[[int, ray.ObjectRef[Any]], bytes | None] | None = None,
              ) -> dict[int, bytes]:
        """The answers to `refs` from `ranks` (default: all), watching every
        pending call meanwhile: a lost actor or an error reply from any rank
        fails the executor. Answers not waited for stay pending. `read`
        decodes a finished call (default: a WorkerReply frame)."""
        read = read or self._reply
        wanted = set(range(self.world_size)) if ranks is None else ranks
        self._pending.update(refs)
        answers: dict[int, bytes] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(ref in self._pending and self._pending[ref] in wanted for ref in refs):
            ready, _ = ray.wait(list(self._pending), num_returns=1, timeout=POLL_S)
            for ref in ready:
                rank = self._pending.pop(ref)
                answer = read(rank, ref)
                if ref in refs and answer is not None:
                    answers[rank] = answer
            if not ready and deadline is not None and time.monotonic() > deadline:
                missing = sorted({rank for ref, rank in self._pending.items() if ref in refs} & wanted)
                raise self._fail(RankFailedError(missing[0], f"no answer to {method} in {timeout_s:.0f} s"))
        return answers

    def _get(self, rank: int, ref: ray.ObjectRef[Any]) -> bytes | None:
        """One finished call's bytes; a lost actor fails the executor."""
        try:
            answer: bytes | None = ray.get(ref)
        except RayActorError as exc:
            raise self._fail(RankFailedError(rank, describe_actor_loss(exc))) from exc
        except RayError as exc:
            raise self._fail(RankFailedError(rank, f"Ray call failed: {str(exc).splitlines()[0]}")) from exc
        return answer

    def _reply(self, rank: int, ref: ray.ObjectRef[Any]) -> bytes | None:
        """One finished call's WorkerReply frame; an error reply fails the executor."""
        answer = self._get(rank, ref)
        if answer is not None:
            reply = reply_decoder.decode(answer)
            if reply.error is not None:
                raise_reply_error(reply, self._blame)
        return answer

    def _blame(self, error: RankFailedError) -> RankFailedError:
        """Fail with `error`, unless another rank's actor turns out to be lost:
        a collective that breaks on one rank is often the echo of a peer gone
        (its socket reset), and the lost rank is the one to name."""
        others = [ref for ref, rank in self._pending.items() if rank != error.rank]
        ready, _ = ray.wait(others, num_returns=len(others), timeout=LOSS_GRACE_S) if others else ([], [])
        for ref in ready:
            rank = self._pending.pop(ref)
            try:
                ray.get(ref)
            except RayActorError as exc:
                return self._fail(RankFailedError(rank, describe_actor_loss(exc)))
            except RayError:
                pass  # a failed call on a live rank: `error` stands
        return self._fail(error)

    def check_health(self) -> None:
        """Raise (RankFailedError) if a rank has failed, its actor is lost, or it does not answer."""
        self._raise_if_failed()
        self._run_all("check_health", (), timeout_s=HEALTH_TIMEOUT_S)

    # ----------------------------------------------------------- shutdown

    def shutdown(self) -> None:
        self._join_step_thread()
        if self._shut_down:
            return
        self._shut_down = True
        if self._failure is None and self._actors:
            with contextlib.suppress(RankFailedError):  # stopped below all the same
                self._run_all("shutdown", (), timeout_s=STOP_GRACE_S)
        for actor in self._actors:
            with contextlib.suppress(RayError):
                ray.kill(actor, no_restart=True)
        self._pending.clear()
        if self._placement_group is not None:
            with contextlib.suppress(RayError):
                remove_placement_group(self._placement_group)
        if self._owns_ray_session:
            ray.shutdown()
