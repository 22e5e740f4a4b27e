"""The runner's side of drafts under async scheduling.

With async scheduling the scheduler plans step k+1 before it has seen step
k's output: it does not know how many of step k's drafts were accepted, nor
the drafts proposed at the end of step k. So it counts every draft of step k
as accepted (num_computed_tokens runs ahead by the rejected ones) and gives
step k+1 DRAFT_PLACEHOLDER entries instead of drafts. The runner knows both:
it places step k+1 right after step k's accepted tokens (the KV slots of the
rejected drafts are simply overwritten) and verifies in the placeholders'
place the drafts it proposed, never round-tripped through the scheduler.
Fewer drafts than placeholders (the policy chose fewer, the drafter found
fewer) is fine: the step computes 1 + the drafts it has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.core.scheduler_output import DRAFT_PLACEHOLDER

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pagedllm.core.scheduler_output import CachedRequestData, ModelRunnerOutput, SchedulerOutput


class DraftPlaceholders:
    def __init__(self) -> None:
        # req_id -> the drafts proposed at the end of its last sampling step.
        self.proposed: dict[str, list[int]] = {}
        # req_id -> positions of its last sampling step the scheduler counted
        # as computed that hold no kept token (its drafts past the accepted prefix).
        self.num_rejected: dict[str, int] = {}

    def num_computed_tokens(self, cached: CachedRequestData) -> int:
        """The request's computed tokens: the scheduler's count, less the
        drafts its step in flight (when this one was scheduled) rejected."""
        if cached.num_output_placeholders and not cached.resumed_from_preemption:
            return cached.num_computed_tokens - self.num_rejected.get(cached.req_id, 0)
        return cached.num_computed_tokens

    def fill(
        self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput
    ) -> tuple[dict[str, int], dict[str, list[int]]]:
        """This step's tokens and drafts per request, the placeholders replaced
        by the proposed drafts (up to as many); `output` records how many."""
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        if not any(drafts[0] == DRAFT_PLACEHOLDER for drafts in spec_tokens.values() if drafts):
            return scheduler_output.num_scheduled_tokens, spec_tokens
        num_scheduled = dict(scheduler_output.num_scheduled_tokens)
        filled = dict(spec_tokens)
        for req_id, drafts in spec_tokens.items():
            if drafts and drafts[0] == DRAFT_PLACEHOLDER:
                proposed = self.proposed.get(req_id, [])[: len(drafts)]
                filled[req_id] = proposed
                num_scheduled[req_id] -= len(drafts) - len(proposed)
                output.num_placeholder_drafts[req_id] = len(proposed)
        return num_scheduled, filled

    def record(self, scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """After a step: each sampling request's rejected positions (counted
        against the drafts the scheduler scheduled) and its next drafts."""
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        for req_id, sampled in output.sampled_token_ids.items():
            if sampled:
                self.num_rejected[req_id] = len(spec_tokens.get(req_id, ())) + 1 - len(sampled)
                self.proposed[req_id] = output.spec_token_ids.get(req_id, [])

    def forget(self, req_ids: Iterable[str]) -> None:
        for req_id in req_ids:
            self.proposed.pop(req_id, None)
            self.num_rejected.pop(req_id, None)
