"""least_loaded: vLLM's data-parallel balancing (4 x waiting + running)."""

from __future__ import annotations

from collections.abc import Sequence

from pagedllm.routers.base import ReplicaState, RouteRequest, RoutingDecision, RoutingPolicy, least_loaded


class LeastLoadedPolicy(RoutingPolicy):
    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RoutingDecision:
        return RoutingDecision(least_loaded(replicas).index)
