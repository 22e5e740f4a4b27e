"""What a front end over data-parallel engines (replicas) knows of them and
decides: the routing policy's choice for each request, each replica's
requests in flight, load and cached block hashes (mirrored from its KV
events), and what happens when one dies. Transport-free: the async client
(AsyncLLM's, engine/dp_client.py) and the blocking one (LLM's) move the
messages; this decides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from pagedllm.core.errors import EngineDeadError
from pagedllm.plugins import get_plugin_manager
from pagedllm.routers.base import ReplicaState, RouteRequest
from pagedllm.routers.cache_mirror import PromptHasher, ReplicaCacheMirror

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.stats import SchedulerStats
    from pagedllm.engine.kv_event_log import KVEventLog
    from pagedllm.engine.wire import EngineCoreOutputs, EngineCoreRequest
    from pagedllm.routers.base import RoutingDecision, RoutingPolicy


class RoutingObserver(Protocol):
    """Where routing decisions are counted (the Prometheus exporter)."""

    def record_route(self, replica: int, reason: str) -> None: ...

    def record_hit_tokens(self, replica: int, predicted: int, actual: int) -> None: ...

    def record_replica_dead(self, replica: int) -> None: ...


@dataclass
class ReplicaFailure:
    """A replica died: the engine requests it held fail with `error`."""

    replica: int
    request_ids: list[str]
    error: EngineDeadError


@dataclass
class ReplicaBook:
    """One replica as the front end knows it."""

    index: int
    alive: bool = True
    error: EngineDeadError | None = None
    mirror: ReplicaCacheMirror = field(default_factory=ReplicaCacheMirror)
    # Engine request id -> the hit tokens predicted when it was routed (None
    # for a request's later samples, which are not routing decisions).
    in_flight: dict[str, int | None] = field(default_factory=dict)
    stats: SchedulerStats | None = None
    num_routed: int = 0


def replica_configs(config: EngineConfig, mirror_caches: bool) -> list[EngineConfig]:
    """Each replica's config: its data_parallel_rank, and KV events on when
    the front end mirrors the replicas' caches."""
    parallel, cache = config.parallel, config.cache
    return [
        config.model_copy(update={
            "parallel": parallel.model_copy(update={"data_parallel_rank": index}),
            "cache": cache.model_copy(update={"enable_kv_events": cache.enable_kv_events or mirror_caches}),
        })
        for index in range(parallel.data_parallel_size)
    ]


class ReplicaRouter:
    def __init__(self, config: EngineConfig) -> None:
        parallel, cache = config.parallel, config.cache
        policy_cls = get_plugin_manager().routers.load(parallel.routing_policy)  # UnknownComponentError lists names
        self.policy_name = parallel.routing_policy
        self.policy: RoutingPolicy = policy_cls()
        # The replicas' caches are mirrored (what every policy may weigh, and
        # the predicted hits /metrics compares) unless there is none to mirror.
        self.hasher: PromptHasher | None = None
        if cache.enable_prefix_caching:
            self.hasher = PromptHasher(cache.block_size, cache.prefix_caching_hash_algo)
        self.books = [ReplicaBook(index) for index in range(parallel.data_parallel_size)]
        self.observer: RoutingObserver | None = None
        # The server's log of what every replica caches (GET /v1/kv_events), when kept.
        self.event_log: KVEventLog | None = None
        self.dead_error: EngineDeadError | None = None
        # The replicas' scheduler stats merged (the latest of each).
        self.scheduler_stats: SchedulerStats | None = None

    @property
    def mirrors_caches(self) -> bool:
        return self.hasher is not None

    def live(self) -> list[ReplicaBook]:
        return [book for book in self.books if book.alive]

    def check_alive(self) -> None:
        """Raise EngineDeadError once every replica is dead."""
        if self.dead_error is None and not self.live():
            causes = "; ".join(f"replica {book.index}: {book.error}" for book in self.books)
            self.dead_error = EngineDeadError(f"every engine replica died ({causes})")
        if self.dead_error is not None:
            raise self.dead_error

    def health(self) -> list[dict[str, Any]]:
        """Each replica: alive, or the error it died of."""
        return [{"replica": b.index, "alive": b.alive, **({"error": str(b.error)} if b.error else {})}
                for b in self.books]

    # ------------------------------------------------------------- requests

    def route(self, requests: list[EngineCoreRequest]) -> int:
        """The replica for one request's engine requests (its samples), now
        counted in flight there."""
        self.check_alive()
        first = requests[0]
        states = self._states(first)
        decision = self.policy.route(RouteRequest(first.request_id, len(first.prompt_token_ids)), states)
        chosen = self._chosen(decision, states)
        book = self.books[chosen.index]
        book.num_routed += 1
        for request in requests:
            book.in_flight[request.request_id] = chosen.num_cached_tokens if request is first else None
        if self.observer is not None:
            self.observer.record_route(chosen.index, decision.reason)
        return chosen.index

    def _states(self, request: EngineCoreRequest) -> list[ReplicaState]:
        lora = getattr(request, "lora", None)  # the adapter's LoRARef (EngineCoreRequest.lora)
        lora_digest = None if lora is None else lora.digest
        hashes = [] if self.hasher is None else self.hasher(request.prompt_token_ids, request.cache_salt, lora_digest)
        block_size = 0 if self.hasher is None else self.hasher.block_size
        return [
            ReplicaState(
                index=book.index,
                num_in_flight=len(book.in_flight),
                num_running=book.stats.num_running_reqs if book.stats is not None else 0,
                num_waiting=book.stats.num_waiting_reqs if book.stats is not None else 0,
                num_cached_tokens=book.mirror.num_cached_blocks(hashes) * block_size,
                num_routed=book.num_routed,
            )
            for book in self.live()
        ]

    def _chosen(self, decision: RoutingDecision, states: list[ReplicaState]) -> ReplicaState:
        for state in states:
            if state.index == decision.replica:
                return state
        raise RuntimeError(f"routing policy {self.policy_name!r} chose replica {decision.replica}, "
                           f"not a live one ({[state.index for state in states]})")

    def unroute(self, replica: int, request_ids: list[str]) -> None:
        """These requests never reached `replica` (the send failed)."""
        for request_id in request_ids:
            self.books[replica].in_flight.pop(request_id, None)

    def abort(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The live replicas holding these requests, each with its own (no longer in flight)."""
        by_replica: dict[int, list[str]] = {}
        for book in self.live():
            mine = [request_id for request_id in request_ids if request_id in book.in_flight]
            for request_id in mine:
                del book.in_flight[request_id]
            if mine:
                by_replica[book.index] = mine
        return by_replica

    # -------------------------------------------------------------- outputs

    def observe(self, replica: int, message: EngineCoreOutputs) -> EngineCoreOutputs:
        """Learn from a replica's step: its cache's events, its finished
        requests (their predicted and actual hits), its stats. Returns the
        message with the stats merged over the replicas."""
        book = self.books[replica]
        book.mirror.apply(message.kv_events)
        if self.event_log is not None:
            self.event_log.apply(replica, message.kv_events)
        for output in message.outputs:
            if output.finish_reason is None or output.request_id not in book.in_flight:
                continue
            predicted = book.in_flight.pop(output.request_id)
            if predicted is not None and self.observer is not None:
                self.observer.record_hit_tokens(replica, predicted, max(output.num_cached_tokens, 0))
        if message.scheduler_stats is None:
            return message
        book.stats = message.scheduler_stats
        self.scheduler_stats = self._merged_stats(message.scheduler_stats)
        return msgspec.structs.replace(message, scheduler_stats=self.scheduler_stats)

    def _merged_stats(self, stats: SchedulerStats) -> SchedulerStats:
        """`stats`' deltas (prefix cache, drafts, connector), with the state
        gauges summed over the live replicas (KV usage: their mean)."""
        latest = [book.stats for book in self.live() if book.stats is not None]
        return msgspec.structs.replace(
            stats,
            num_running_reqs=sum(s.num_running_reqs for s in latest),
            num_waiting_reqs=sum(s.num_waiting_reqs for s in latest),
            kv_cache_usage=sum(s.kv_cache_usage for s in latest) / len(latest),
            num_preemptions=sum(s.num_preemptions for s in latest),
        )

    def merge_stats(self, latest: dict[int, SchedulerStats]) -> SchedulerStats | None:
        """Fresh stats of these replicas as one: gauges merged, the
        prefix-cache counts summed (drafts and connector counts: the first's)."""
        if not latest:
            return None
        for index, stats in latest.items():
            self.books[index].stats = stats
        merged = self._merged_stats(next(iter(latest.values())))
        self.scheduler_stats = msgspec.structs.replace(
            merged,
            prefix_cache_queries=sum(stats.prefix_cache_queries for stats in latest.values()),
            prefix_cache_hits=sum(stats.prefix_cache_hits for stats in latest.values()),
        )
        return self.scheduler_stats

    def died(self, replica: int, error: EngineDeadError) -> ReplicaFailure:
        """`replica` is dead: out of routing; what it held fails with `error`
        (EngineDeadError instead when it was the last one)."""
        book = self.books[replica]
        book.alive, book.error = False, error
        request_ids, book.in_flight = list(book.in_flight), {}
        if self.observer is not None:
            self.observer.record_replica_dead(replica)
        self.check_alive()
        return ReplicaFailure(replica, request_ids, error)


__all__ = ["ReplicaBook", "ReplicaFailure", "ReplicaRouter", "RoutingObserver", "replica_configs"]
