"""delayed_free: a KV connector whose "saves" finish late, and later on
higher ranks, for the delayed-free contract at every tensor-parallel size.

It is the CPU tier (`cpu_offload`) plus: the scheduler side keeps every
finished request's blocks (`request_finished` returns True); a worker side
reports a request done `1 + 2 * rank` steps after it learns that the request
finished, and counts each report in `stats.tier_hits["delayed"]`. The blocks
may be freed only once every rank has reported.
"""

from __future__ import annotations

from typing import Any

from pagedllm.kv_connectors.cpu_offload import CpuOffloadConnector

TIER = "delayed"


class DelayedFreeConnector(CpuOffloadConnector):
    def __init__(self, config: Any, context: Any) -> None:
        super().__init__(config, context)
        self.steps_left: dict[str, int] = {}  # worker side: request -> steps until its "save" is done
        self.held: set[str] = set()  # scheduler side: requests whose blocks are kept

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        super().request_finished(request, block_ids)
        self.held.add(request.request_id)
        return True

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        for request_id in finished_req_ids:
            self.steps_left[request_id] = 1 + 2 * self.context.tp_rank
        done = set()
        for request_id in list(self.steps_left):
            self.steps_left[request_id] -= 1
            if self.steps_left[request_id] < 0:
                del self.steps_left[request_id]
                done.add(request_id)
        self.stats.count("tier_hits", TIER, len(done))
        return done, set()
