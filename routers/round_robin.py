"""round_robin: each request to the next live replica in turn."""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.routers.base import ReplicaState, RouteRequest, RoutingDecision, RoutingPolicy


class RoundRobinPolicy(RoutingPolicy):
    def __init__(self) -> None:
        self._next = 0

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RoutingDecision:
        # The first live replica at or after the turn (a dead one's turn passes on).
        after = [replica for replica in replicas if replica.index >= self._next]
        chosen = after[0] if after else replicas[0]
        self._next = chosen.index + 1
        return RoutingDecision(chosen.index)
