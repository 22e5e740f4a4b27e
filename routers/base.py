"""The routing-policy interface (plugin kind `router`): which of several
data-parallel engines (replicas) serves a request.

The front end (one API server over `-dp N` engine cores, or `pagedllm
router` over several servers) builds, for every request, what a policy may
weigh about each live replica: its load (the requests this front end routed
there and has not seen finish, and what the replica's scheduler last
reported) and how many of the prompt's leading tokens the replica's prefix
cache holds. The front end learns that from the replicas' KV events
(core/kv_cache/events.py) and hashes the prompt's blocks the way the engines
do, so the figure is exact while the events are current (it is 0 with
prefix caching off). The policy answers with a replica and why.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

# vLLM's data-parallel load score weighs a queued request 4x a running one.
WAITING_WEIGHT = 4


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    num_prompt_tokens: int


@dataclass(frozen=True)
class ReplicaState:
    """One live replica, as the front end knows it when a request arrives."""

    index: int
    # Requests this front end routed here that have not finished (exact, immediate).
    num_in_flight: int
    # What the replica's scheduler reported last.
    num_running: int
    num_waiting: int
    # Tokens of this request's prompt the replica's prefix cache holds, from
    # its start (whole blocks; the last prompt token always computes).
    num_cached_tokens: int = 0
    # Requests this front end has routed here since it started.
    num_routed: int = 0

    @property
    def load(self) -> int:
        """vLLM's score: 4 x waiting + running, where waiting also counts the
        requests routed here that the replica has not reported yet."""
        waiting = max(self.num_waiting, self.num_in_flight - self.num_running)
        return WAITING_WEIGHT * waiting + self.num_running


@dataclass(frozen=True)
class RoutingDecision:
    replica: int  # a ReplicaState.index
    # "prefix": chosen for the prefix its cache holds; "load": for its load or turn.
    reason: Literal["prefix", "load"] = "load"


class RoutingPolicy(ABC):
    """Built as ``PolicyCls()`` once per front end; `route` runs on the
    front end's event loop for every request, so it must be quick."""

    @abstractmethod
    def route(self, request: RouteRequest, replicas: Sequence[ReplicaState]) -> RoutingDecision:
        """The replica for `request`; `replicas` are the live ones (never empty), by index."""


def least_loaded(replicas: Sequence[ReplicaState]) -> ReplicaState:
    """The replica with the lowest load; ties go to the fewest in flight, then
    the fewest routed so far (requests one at a time spread out), then the
    lowest index."""
    return min(replicas, key=lambda r: (r.load, r.num_in_flight, r.num_routed, r.index))


__all__ = ["WAITING_WEIGHT", "ReplicaState", "RouteRequest", "RoutingDecision", "RoutingPolicy", "least_loaded"]
