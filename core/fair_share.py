"""Fair sharing of the running seats (`scheduler.max_num_seqs`) between groups.

A group is one API request: all its prompts and all their `n` samples
(`Request.group_id`). Without sharing, first-come-first-served lets one
request of 1,024 sequences hold every seat until its sequences end, and a
2-token request behind it waits minutes. With sharing, while another group
waits, no group keeps more than its share of the seats:

- the share is `max_num_seqs // number of groups` (running or ready to run),
  at least 1;
- a group *starves* when it has a sequence ready to run and fewer running
  than the share;
- a waiting sequence of a group at or above its share steps aside (keeps its
  place) while a starved group waits, so free seats go to the starved first;
- when a starved group still got no seat in a step, the scheduler preempts
  (recompute) the newest sequence of the group furthest above the share, so
  the starved group is admitted within a step or two.

Work-conserving: a group alone takes every seat. Priorities stay in charge
under the priority policy: a group only yields to groups of the same or a
better (lower) priority. One `FairShare` is built per step, only when
requests wait; it costs one pass over the unfinished requests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedllm.core.request import RequestStatus

if TYPE_CHECKING:
    from pagedllm.core.request import Request


@dataclass(slots=True)
class GroupState:
    """One group's seats this step."""

    priority: int
    arrival_time: float
    num_running: int = 0
    # Sequences ready to run (waiting or preempted; a grammar compiled).
    num_ready_waiting: int = 0


def is_ready_to_run(request: Request) -> bool:
    """A waiting request that could be admitted now (its grammar, if any, is compiled)."""
    status = request.status
    if status is RequestStatus.WAITING_FOR_FSM:
        so_request = request.structured_output_request
        return so_request is not None and so_request.is_ready()
    return status is RequestStatus.WAITING or status is RequestStatus.PREEMPTED


class FairShare:
    """The seats each group holds in one step, and who yields to whom."""

    def __init__(
        self, running: list[Request], unfinished: Iterable[Request], max_num_seqs: int, by_priority: bool
    ) -> None:
        self.by_priority = by_priority
        # NOTE: comprehensions over the requests, no call per request: this
        # runs every step while requests wait (1,000s of them).
        waiting, running_status = RequestStatus.WAITING, RequestStatus.RUNNING
        ready = [
            r for r in unfinished
            if r.status is waiting or (r.status is not running_status and is_ready_to_run(r))
        ]
        num_running = Counter([r.group_id for r in running])
        num_ready = Counter([r.group_id for r in ready])
        # Each group's priority and arrival, from its first sequence seen.
        first = {r.group_id: r for r in reversed(ready)} | {r.group_id: r for r in reversed(running)}
        self.groups = {
            group_id: GroupState(r.priority, r.arrival_time, num_running[group_id], num_ready[group_id])
            for group_id, r in first.items()
        }
        self.share = max(1, max_num_seqs // max(1, len(self.groups)))
        self.starved = {
            group_id for group_id, group in self.groups.items()
            if group.num_ready_waiting and group.num_running < self.share
        }
        # Starved groups that got a seat in this step (they need no preemption).
        self.served: set[str] = set()

    def _yields_to(self, group: GroupState, other: GroupState) -> bool:
        return not self.by_priority or other.priority <= group.priority

    def steps_aside(self, request: Request) -> bool:
        """Should this waiting sequence leave its seat to a starved group?"""
        group = self.groups.get(request.group_id)
        if group is None or group.num_running < self.share:
            return False
        return any(
            group_id != request.group_id and self._yields_to(group, self.groups[group_id])
            for group_id in self.starved
        )

    def admitted(self, request: Request) -> None:
        group = self.groups.get(request.group_id)
        if group is None:
            return
        group.num_running += 1
        group.num_ready_waiting -= 1
        self.served.add(request.group_id)
        if group.num_running >= self.share or not group.num_ready_waiting:
            self.starved.discard(request.group_id)

    def preempted(self, request: Request) -> None:
        group = self.groups.get(request.group_id)
        if group is not None:
            group.num_running -= 1
            group.num_ready_waiting += 1

    def victim(self, running: list[Request]) -> Request | None:
        """The sequence to preempt for a starved group that got no seat this
        step: the newest of the group furthest above the share among those
        that yield to it; None if no group owes it a seat."""
        unserved = [self.groups[group_id] for group_id in self.starved - self.served]
        if not unserved:
            return None
        # The neediest: the best priority (under the priority policy), then the oldest.
        neediest = min(unserved, key=lambda g: (g.priority if self.by_priority else 0, g.arrival_time))
        # The worst priority (under the priority policy), then the most seats, then the newest.
        candidates = [
            (group.priority if self.by_priority else 0, group.num_running, group.arrival_time, group_id)
            for group_id, group in self.groups.items()
            if group.num_running > self.share and self._yields_to(group, neediest)
        ]
        if not candidates:
            return None
        victim_group = max(candidates)[-1]
        return next((r for r in reversed(running) if r.group_id == victim_group), None)
