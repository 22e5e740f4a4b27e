"""Merging the ranks' KV connector reports into the one the scheduler reads.

Each rank's worker side reports, after every step, the requests whose
delayed save (or async load) it has finished, and its counts. A request is
done when every rank has said so, in the same step or not (vLLM's
`KVOutputAggregator`); counts are summed (every rank moves its own shard).
"""

from __future__ import annotations

from collections.abc import Iterable

from pagedllm.core.scheduler_output import KVConnectorOutput, KVConnectorStats


class KVOutputAggregator:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        # request id -> ranks that have reported it (until all have).
        self._sending: dict[str, int] = {}
        self._recving: dict[str, int] = {}

    def merge(self, outputs: Iterable[KVConnectorOutput | None]) -> KVConnectorOutput:
        stats = KVConnectorStats()
        merged = KVConnectorOutput(stats=stats)
        for output in outputs:
            if output is None:
                continue
            self._count(output.finished_sending, self._sending, merged.finished_sending)
            self._count(output.finished_recving, self._recving, merged.finished_recving)
            if output.stats is not None:
                stats.add(output.stats)
        return merged

    def _count(self, reported: set[str], pending: dict[str, int], done: set[str]) -> None:
        for request_id in reported:
            count = pending.get(request_id, 0) + 1
            if count == self.world_size:
                pending.pop(request_id, None)
                done.add(request_id)
            else:
                pending[request_id] = count


__all__ = ["KVOutputAggregator"]
