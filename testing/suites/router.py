"""The router (data-parallel routing policy) suite: built with no arguments,
it always answers one of the live replicas it was given, whatever their
indices, loads and cached prefixes."""

from __future__ import annotations

import random
from typing import Any

from pagedllm.testing.components import instantiate
from pagedllm.testing.suite import ConformanceError, Suite

KIND = "router"
SUITE = Suite(KIND)


def _policy(rule: str, name: str) -> Any:
    return instantiate(rule, KIND, name)


def _replicas(rng: random.Random, indices: list[int]) -> list[Any]:
    from pagedllm.routers.base import ReplicaState

    return [
        ReplicaState(index, num_in_flight=rng.randrange(0, 6), num_running=rng.randrange(0, 4),
                     num_waiting=rng.randrange(0, 4), num_cached_tokens=16 * rng.randrange(0, 4),
                     num_routed=rng.randrange(0, 20))
        for index in indices
    ]


@SUITE.rule("routes-to-a-live-replica")
def check_live_replica(name: str) -> None:
    """Over random replica sets (indices with gaps: replicas that died), every
    decision is a RoutingDecision naming one of the given replicas, reason 'prefix' or 'load'."""
    from pagedllm.routers.base import RouteRequest, RoutingDecision

    rule = "routes-to-a-live-replica"
    policy = _policy(rule, name)
    rng = random.Random(0)
    for number in range(200):
        indices = sorted(rng.sample(range(8), rng.randrange(1, 6)))
        request = RouteRequest(f"req-{number}", num_prompt_tokens=rng.randrange(1, 200))
        decision = policy.route(request, _replicas(rng, indices))
        if not isinstance(decision, RoutingDecision):
            raise ConformanceError(rule, f"route() returned {decision!r}, not a RoutingDecision")
        if decision.replica not in indices:
            raise ConformanceError(rule, f"route() chose replica {decision.replica}; the live ones are {indices}")
        if decision.reason not in ("prefix", "load"):
            raise ConformanceError(rule, f"route() gave reason {decision.reason!r}")


@SUITE.rule("single-replica")
def check_single_replica(name: str) -> None:
    """With one live replica (of any index), that replica is chosen."""
    from pagedllm.routers.base import RouteRequest

    rule = "single-replica"
    policy = _policy(rule, name)
    rng = random.Random(1)
    for index in (0, 3):
        decision = policy.route(RouteRequest(f"only-{index}", 10), _replicas(rng, [index]))
        if decision.replica != index:
            raise ConformanceError(rule, f"the only live replica is {index}, route() chose {decision.replica}")
