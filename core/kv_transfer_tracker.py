"""The scheduler's KV-transfer bookkeeping, in one place.

The scheduler owns the KV connector's scheduler side and calls this tracker
in short phases of its step:

- admission: `num_external_tokens` (how many tokens past the local hit the
  connector loads) and `after_alloc` (the admitted request's blocks);
- the step's output: `attach_metadata` (eviction events, then the worker
  sides' instructions for the step);
- a request that finishes: `request_finished` (True: its blocks stay
  allocated while a save still reads them, the delayed free);
- the step's results: `update_from_output` (blocks whose delayed save every
  rank has reported done are freed; the worker sides' counts are added).

The connector's counts are its scheduler side's own plus what the ranks'
worker sides reported with their step outputs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.scheduler_output import KVConnectorStats

if TYPE_CHECKING:
    from pagedllm.core.kv_cache.manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import KVConnectorOutput, SchedulerOutput
    from pagedllm.kv_connectors.base import KVConnectorBase


class KVTransferTracker:
    def __init__(self, connector: KVConnectorBase, kv_cache_manager: KVCacheManager) -> None:
        self.connector = connector
        self.kv_cache_manager = kv_cache_manager
        if connector.wants_eviction_events:
            kv_cache_manager.record_evictions()
        # Finished requests whose blocks a connector still reads (freed when
        # the worker sides' get_finished has listed them, on every rank).
        self.delayed_free: dict[str, Request] = {}
        # The worker sides' counts since start (every rank's, from the steps' outputs).
        self._worker_stats = KVConnectorStats()
        self._last_stats = KVConnectorStats()

    # ------------------------------------------------------------ admission

    def num_external_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens the connector loads past the local hit of
        `num_computed_tokens` (None: ask again later). Raises
        KVTransferError when the request's load failed under `fail`."""
        if request.sampling_params.prompt_logprobs is not None:
            return 0  # prompt logprobs need every prompt position computed
        self.kv_cache_manager.ensure_block_hashes(request)
        num_external = self.connector.get_num_new_matched_tokens(request, num_computed_tokens)
        if num_external is None:
            return None
        # The last prompt position is always computed (its logits sample).
        return max(0, min(num_external, request.num_tokens - 1 - num_computed_tokens))

    def after_alloc(self, request: Request, num_external_tokens: int) -> None:
        """The admitted request holds its blocks: the connector learns which
        ones the `num_external_tokens` load into."""
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        self.connector.update_state_after_alloc(request, block_ids, num_external_tokens)

    # ------------------------------------------------------------- the step

    def attach_metadata(self, scheduler_output: SchedulerOutput) -> None:
        """The worker sides' instructions for the step, on its output."""
        connector = self.connector
        if connector.wants_eviction_events:
            connector.on_blocks_evicted(self.kv_cache_manager.take_evicted_blocks())
        # NOTE: before num_computed_tokens advances: the connector reads
        # where each request's new tokens start.
        scheduler_output.kv_connector_metadata = connector.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request) -> bool:
        """True: the request's blocks stay allocated until every rank has
        reported its save done (the caller must not free them)."""
        block_ids = self.kv_cache_manager.get_block_ids(request.request_id)
        if not self.connector.request_finished(request, block_ids):
            return False
        self.delayed_free[request.request_id] = request
        return True

    def update_from_output(self, kv_output: KVConnectorOutput | None) -> None:
        """Free the blocks of finished requests whose delayed save is done
        (on every rank); count the worker sides' transfers."""
        if kv_output is None:
            return
        for request_id in kv_output.finished_sending:
            request = self.delayed_free.pop(request_id, None)
            if request is not None:
                self.kv_cache_manager.free(request)
        if kv_output.stats is not None:
            self._worker_stats.add(kv_output.stats)

    # ---------------------------------------------------------------- stats

    @property
    def stats(self) -> KVConnectorStats:
        """The counts since start: the scheduler side's and the worker
        sides' (summed over the ranks)."""
        total = self.connector.stats.copy()
        total.add(self._worker_stats)
        return total

    def take_stats(self) -> KVConnectorStats:
        """The counts since the previous call."""
        now = self.stats
        delta, self._last_stats = now.minus(self._last_stats), now
        return delta


__all__ = ["KVTransferTracker"]
