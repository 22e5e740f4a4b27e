"""Routing among data-parallel engines, without engines: the prefix cache's
KV events, the front end's mirror of them and its prompt hashes (equal to
the engine's), the three built-in policies' choices on hand-built replica
states, the router plugin kind, and the front end's bookkeeping
(engine/dp_router.py): in-flight counts, predicted vs reported hits, merged
stats, a dead replica's requests."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import EngineDeadError, UnknownComponentError
from pagedllm.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.stats import SchedulerStats
from pagedllm.engine.dp_router import ReplicaRouter, replica_configs
from pagedllm.engine.wire import EngineCoreOutputs, EngineCoreRequest
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl
from pagedllm.routers.base import ReplicaState, RouteRequest, RoutingDecision, RoutingPolicy
from pagedllm.routers.cache_mirror import PromptHasher, ReplicaCacheMirror
from pagedllm.routers.least_loaded import LeastLoadedPolicy
from pagedllm.routers.prefix_aware import PrefixAwarePolicy
from pagedllm.routers.round_robin import RoundRobinPolicy

BLOCK = 4


def _request(request_id: str, tokens: list[int], salt: str | None = None) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4), None, cache_salt=salt)


# ------------------------------------------------------------- KV events


def test_the_prefix_cache_reports_the_hashes_it_gains_and_loses_in_order() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK, enable_caching=True)
    manager.record_kv_events()
    first = _request("a", list(range(10)))  # 2 full blocks + 2 tokens
    manager.allocate_slots(first, 10)
    assert manager.take_kv_events() == [BlockStored(list(first.block_hashes[:2]))]
    assert manager.take_kv_events() == []
    manager.free(first)
    # A request needing all 4 blocks reuses both cached ones: their hashes go.
    second = _request("b", list(range(100, 116)))
    manager.allocate_slots(second, 16)
    events = manager.take_kv_events()
    assert [type(event) for event in events] == [BlockRemoved, BlockStored]
    assert sorted(events[0].block_hashes) == sorted(first.block_hashes[:2])
    assert events[1].block_hashes == list(second.block_hashes)
    manager.free(second)
    assert manager.reset_prefix_cache()
    assert manager.take_kv_events() == [AllBlocksCleared()]


def test_without_recording_no_events_are_kept() -> None:
    manager = KVCacheManager(num_blocks=4, block_size=BLOCK, enable_caching=True)
    manager.allocate_slots(_request("a", list(range(10))), 10)
    assert manager.take_kv_events() == []


@pytest.mark.parametrize("salt", [None, "tenant-7"])
def test_the_front_end_hashes_a_prompt_as_the_engine_does(salt: str | None) -> None:
    tokens = list(range(3, 3 + 4 * BLOCK + 1))  # 4 full blocks and one token
    manager = KVCacheManager(num_blocks=8, block_size=BLOCK, enable_caching=True, hash_algo="sha256")
    request = _request("a", tokens, salt)
    manager.ensure_block_hashes(request)
    assert PromptHasher(BLOCK, "sha256")(tokens, salt) == list(request.block_hashes)
    # A prompt of whole blocks: its last block always computes, so it is not hittable.
    assert PromptHasher(BLOCK, "sha256")(tokens[:-1], salt) == list(request.block_hashes[:3])
    assert PromptHasher(BLOCK, "sha256")(tokens, "other") != list(request.block_hashes)


def test_the_mirror_follows_the_events_and_measures_held_prefixes() -> None:
    mirror = ReplicaCacheMirror()
    mirror.apply([BlockStored([b"a", b"b", b"c"]), BlockRemoved([b"b"])])
    assert mirror.num_cached_blocks([b"a", b"b", b"c"]) == 1  # c alone is not a prefix
    mirror.apply([BlockStored([b"b"])])
    assert mirror.num_cached_blocks([b"a", b"b", b"c", b"d"]) == 3
    assert mirror.num_cached_blocks([b"x", b"a"]) == 0
    mirror.apply([AllBlocksCleared(), BlockStored([b"x"])])
    assert mirror.block_hashes == {b"x"}


# --------------------------------------------------------------- policies


def _state(index: int, *, in_flight: int = 0, running: int = 0, waiting: int = 0, cached: int = 0,
           routed: int = 0) -> ReplicaState:
    return ReplicaState(index, in_flight, running, waiting, cached, routed)


REQUEST = RouteRequest("r", 40)


def test_load_is_vllms_score_with_unreported_requests_counted_as_waiting() -> None:
    assert _state(0, in_flight=3, running=3, waiting=0).load == 3
    assert _state(0, in_flight=5, running=2, waiting=1).load == 4 * 3 + 2  # 3 routed, not running yet
    assert _state(0, in_flight=0, running=1, waiting=2).load == 4 * 2 + 1  # another front end's


def test_round_robin_takes_turns_and_skips_a_dead_replica() -> None:
    policy = RoundRobinPolicy()
    three = [_state(0), _state(1), _state(2)]
    assert [policy.route(REQUEST, three).replica for _ in range(4)] == [0, 1, 2, 0]
    without_2 = [_state(0), _state(1)]
    assert [policy.route(REQUEST, without_2).replica for _ in range(3)] == [1, 0, 1]


def test_least_loaded_picks_the_lowest_score_and_spreads_ties() -> None:
    policy = LeastLoadedPolicy()
    assert policy.route(REQUEST, [_state(0, running=2), _state(1, waiting=1)]).replica == 0  # 2 < 4
    assert policy.route(REQUEST, [_state(0, routed=3), _state(1, routed=2)]).replica == 1
    assert policy.route(REQUEST, [_state(0, routed=2), _state(1, routed=2)]) == RoutingDecision(0, "load")


def test_prefix_aware_prefers_the_longest_cached_prefix() -> None:
    policy = PrefixAwarePolicy()
    replicas = [_state(0, cached=16, running=1), _state(1, cached=32, running=3), _state(2)]
    assert policy.route(REQUEST, replicas) == RoutingDecision(1, "prefix")
    # Equal prefixes: the less loaded holder.
    tied = [_state(0, cached=32, running=2), _state(1, cached=32, running=1), _state(2)]
    assert policy.route(REQUEST, tied) == RoutingDecision(1, "prefix")
    # Nothing cached anywhere: by load (the fewest routed on a tie).
    assert policy.route(REQUEST, [_state(0, routed=1), _state(1)]) == RoutingDecision(1, "load")


def test_prefix_aware_gives_up_an_overloaded_holder() -> None:
    policy = PrefixAwarePolicy()
    gap = PrefixAwarePolicy.max_load_gap
    at_limit = [_state(0, cached=32, running=gap), _state(1)]
    assert policy.route(REQUEST, at_limit) == RoutingDecision(0, "prefix")
    over = [_state(0, cached=32, running=gap + 1), _state(1)]
    assert policy.route(REQUEST, over) == RoutingDecision(1, "load")


# ------------------------------------------------------------ the kind


class FirstLivePolicy(RoutingPolicy):
    def route(self, request: RouteRequest, replicas: Any) -> RoutingDecision:
        return RoutingDecision(replicas[-1].index)


class OutOfRangePolicy(RoutingPolicy):
    def route(self, request: RouteRequest, replicas: Any) -> RoutingDecision:
        return RoutingDecision(7)


class TestRouterPlugin:
    @hookimpl
    def register_routers(self, register: RegisterFn) -> None:
        register("last_live", FirstLivePolicy)
        register("out_of_range", OutOfRangePolicy)


@pytest.fixture
def router_plugin() -> Iterator[None]:
    pm = get_plugin_manager()
    pm.register(TestRouterPlugin(), name="test-router")
    yield
    pm.unregister(name="test-router")


def _router(policy: str = "prefix_aware", **flat: Any) -> ReplicaRouter:
    return ReplicaRouter(EngineConfig.from_flat(data_parallel_size=3, routing_policy=policy, block_size=BLOCK, **flat))


def _engine_request(request_id: str, tokens: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, tokens, SamplingParams(), None, 0.0)


def test_the_builtin_routers_are_registered() -> None:
    registry = get_plugin_manager().routers
    assert {name: registry.get(name).target for name in registry.names()} == {
        "round_robin": "pagedllm.routers.round_robin:RoundRobinPolicy",
        "least_loaded": "pagedllm.routers.least_loaded:LeastLoadedPolicy",
        "prefix_aware": "pagedllm.routers.prefix_aware:PrefixAwarePolicy",
    }
    assert EngineConfig().parallel.routing_policy == "prefix_aware"


def test_a_policy_registered_by_a_plugin_is_selected_by_name(router_plugin: None) -> None:
    router = _router("last_live")
    assert isinstance(router.policy, FirstLivePolicy)
    assert router.route([_engine_request("a", [1, 2, 3])]) == 2
    router.died(2, EngineDeadError("gone"))
    assert router.route([_engine_request("b", [1, 2, 3])]) == 1
    refused = r"routing policy 'out_of_range' chose replica 7, not a live one \(\[0, 1, 2\]\)"
    with pytest.raises(RuntimeError, match=refused):
        _router("out_of_range").route([_engine_request("c", [1])])


def test_an_unknown_policy_names_the_registered_ones() -> None:
    with pytest.raises(UnknownComponentError, match="prefix_aware"):
        _router("nearest")


# ------------------------------------------------------ the bookkeeping


class Observed:
    def __init__(self) -> None:
        self.routes: list[tuple[int, str]] = []
        self.hits: list[tuple[int, int, int]] = []
        self.dead: list[int] = []

    def record_route(self, replica: int, reason: str) -> None:
        self.routes.append((replica, reason))

    def record_hit_tokens(self, replica: int, predicted: int, actual: int) -> None:
        self.hits.append((replica, predicted, actual))

    def record_replica_dead(self, replica: int) -> None:
        self.dead.append(replica)


def _outputs(*outputs: EngineCoreOutput, events: Any = (), stats: SchedulerStats | None = None) -> EngineCoreOutputs:
    return EngineCoreOutputs(list(outputs), stats, 0, 0.0, list(events))


def _stats(running: int, waiting: int, usage: float, queries: int = 0) -> SchedulerStats:
    return SchedulerStats(running, waiting, usage, queries, 0, 0)


def test_a_repeat_goes_where_its_prefix_is_and_the_prediction_is_checked() -> None:
    router = _router()
    router.observer = observed = Observed()
    prompt = list(range(2 * BLOCK + 1))
    hashes = PromptHasher(BLOCK, "sha256")(prompt, None)
    assert router.route([_engine_request("a", prompt)]) == 0  # nothing cached: the first of the least loaded
    router.observe(0, _outputs(EngineCoreOutput("a", [5], finish_reason="length", num_cached_tokens=0),
                               events=[BlockStored(hashes)]))
    assert router.route([_engine_request("b", list(range(50, 60)))]) == 1  # another prompt: spread
    assert router.route([_engine_request("c", prompt), _engine_request("c_1", prompt)]) == 0  # the prefix
    assert [len(book.in_flight) for book in router.books] == [2, 1, 0]
    router.observe(0, _outputs(EngineCoreOutput("c", [5], finish_reason="stop", num_cached_tokens=2 * BLOCK),
                               EngineCoreOutput("c_1", [5], finish_reason="stop", num_cached_tokens=2 * BLOCK)))
    assert observed.routes == [(0, "load"), (1, "load"), (0, "prefix")]
    # One decision per request: its later samples are not predictions.
    assert observed.hits == [(0, 0, 0), (0, 2 * BLOCK, 2 * BLOCK)]
    assert [len(book.in_flight) for book in router.books] == [0, 1, 0]


def test_aborts_go_to_the_replicas_holding_the_requests() -> None:
    router = _router("round_robin")
    for request_id in ("a", "b", "c", "d"):
        router.route([_engine_request(request_id, [1, 2])])
    assert router.abort(["a", "d", "c", "zzz"]) == {0: ["a", "d"], 2: ["c"]}
    assert [list(book.in_flight) for book in router.books] == [[], ["b"], []]


def test_stats_merge_the_replicas_gauges_and_keep_this_steps_counts() -> None:
    router = _router()
    router.observe(0, _outputs(stats=_stats(2, 1, 0.5, queries=10)))
    message = router.observe(1, _outputs(stats=_stats(3, 0, 0.25, queries=4)))
    assert message.scheduler_stats == SchedulerStats(5, 1, 0.375, 4, 0, 0)
    merged = router.merge_stats({0: _stats(1, 0, 0.5, queries=3), 2: _stats(0, 2, 0.0, queries=5)})
    assert merged == SchedulerStats(1 + 3 + 0, 0 + 0 + 2, 0.75 / 3, 8, 0, 0)


def test_a_dead_replica_fails_what_it_held_and_leaves_routing() -> None:
    router = _router("round_robin")
    router.observer = observed = Observed()
    for request_id in ("a", "b", "c", "d"):
        router.route([_engine_request(request_id, [1, 2])])
    failure = router.died(0, EngineDeadError("replica 0 crashed"))
    assert (failure.replica, failure.request_ids, str(failure.error)) == (0, ["a", "d"], "replica 0 crashed")
    assert observed.dead == [0]
    assert {router.route([_engine_request(f"n{i}", [1])]) for i in range(4)} == {1, 2}
    assert [entry["alive"] for entry in router.health()] == [False, True, True]
    router.died(1, EngineDeadError("replica 1 crashed"))
    with pytest.raises(EngineDeadError, match="every engine replica died"):
        router.died(2, EngineDeadError("replica 2 crashed"))
    with pytest.raises(EngineDeadError):
        router.route([_engine_request("late", [1])])


def test_each_replica_gets_its_rank_and_kv_events_when_caches_are_mirrored() -> None:
    config = EngineConfig.from_flat(data_parallel_size=2, tensor_parallel_size=2)
    configs = replica_configs(config, mirror_caches=True)
    assert [(c.parallel.data_parallel_rank, c.cache.enable_kv_events) for c in configs] == [(0, True), (1, True)]
    assert all(c.parallel.tensor_parallel_size == 2 for c in configs)
    assert not replica_configs(config, mirror_caches=False)[0].cache.enable_kv_events
    assert _router("round_robin").mirrors_caches and _router().mirrors_caches
    assert not _router(enable_prefix_caching=False).mirrors_caches


# --------------------------------------------------- the server's event log


def test_the_servers_log_numbers_changes_across_replicas_and_snapshots_late_readers() -> None:
    from pagedllm.engine.kv_event_log import KVEventLog

    log = KVEventLog(2, block_size=16, hash_algo="sha256", window=4)
    assert log.read(None) == {"seq": 0, "block_size": 16, "hash_algo": "sha256", "snapshot": True,
                              "block_hashes": []}
    log.apply(0, [BlockStored([b"\x01", b"\x02"])])
    log.apply(1, [BlockStored([b"\x02", b"\x03"])])  # 02 is held already: no change
    assert log.read(0)["events"] == [("stored", "01"), ("stored", "02"), ("stored", "03")]
    log.apply(0, [BlockRemoved([b"\x02"])])  # replica 1 still holds it
    assert log.read(3) == {"seq": 3, "block_size": 16, "hash_algo": "sha256", "snapshot": False, "events": []}
    log.apply(1, [AllBlocksCleared()])  # 02 and 03 are gone from the server
    assert log.read(3)["events"] == [("removed", "02"), ("removed", "03")]
    assert log.read(5)["events"] == []
    # Changes 1 and 2 fell out of the 4-change window: a reader at 0 gets a snapshot.
    assert log.read(0) == {"seq": 5, "block_size": 16, "hash_algo": "sha256", "snapshot": True,
                           "block_hashes": ["01"]}
    assert log.read(1)["snapshot"] is False  # changes 2..5 are all kept
    assert log.read(99)["snapshot"] is True  # from another life of the server
