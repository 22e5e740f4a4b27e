"""prefix_aware (the default): the replica whose prefix cache holds the
longest prefix of the prompt, unless it is overloaded.

Ties (equal prefixes, or none cached anywhere) go to the least loaded
replica. A replica whose load exceeds the least loaded one's by more than
`max_load_gap` loses its affinity (SGLang's router guards the same way): a
hot prefix must not pile every request onto one replica while others idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from pagedllm.routers.base import (
    WAITING_WEIGHT,
    ReplicaState,
    RouteRequest,
    RoutingDecision,
    RoutingPolicy,
    least_loaded,
)


class PrefixAwarePolicy(RoutingPolicy):
    # Load (4 x waiting + running) a cached prefix may cost above the least
    # loaded replica's: 8 queued requests.
    max_load_gap: ClassVar[int] = 8 * WAITING_WEIGHT

    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RoutingDecision:
        lightest = least_loaded(replicas)
        longest = max(replica.num_cached_tokens for replica in replicas)
        if longest == 0:
            return RoutingDecision(lightest.index)
        holders = [replica for replica in replicas if replica.num_cached_tokens == longest]
        best = least_loaded(holders)
        if best.load - lightest.load > self.max_load_gap:
            return RoutingDecision(lightest.index)
        return RoutingDecision(best.index, reason="prefix")
