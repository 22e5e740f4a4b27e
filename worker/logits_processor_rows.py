"""Keeps the logits processors' view of the batch in step with the logits
rows the sampler sees (pagedllm/logits_processors/interface.py).

The rows of a step are its sampling requests in the step's order, one row
each, or, with a drafter, ``1 + n`` rows each (draft positions, then the
bonus position). A row is identified by (request, position); each step the
new layout is compared with the last one and every processor receives the
rows added, removed and moved. Comparing layouts, rather than following the
scheduler's events, makes chunked prefill (a request that does not sample
this step leaves the batch), preemption, async scheduling's extra steps and
a request's changing number of drafts all the same case.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from pagedllm.logits_processors.interface import AddedRequest, BatchUpdate, LogitsProcessor, MovedRequest

if TYPE_CHECKING:
    import torch

    from pagedllm.worker.persistent_batch import CachedRequestState

RowKey = tuple[str, int]  # (request id, number of drafts before the row)


class LogitsProcessorRows:
    def __init__(self, processors: Sequence[LogitsProcessor]) -> None:
        self.processors = list(processors)
        # Last step's rows: key -> (index, the request's state object).
        self._rows: dict[RowKey, tuple[int, CachedRequestState]] = {}
        # Output ids of each draft row (j > 0): the request's outputs then its
        # first j drafts, rewritten in place so processors keep one live list.
        self._draft_outputs: dict[RowKey, list[int]] = {}

    def update(self, states: Sequence[CachedRequestState], drafts: Sequence[Sequence[int]] | None) -> None:
        """Tell every processor about this step's rows: one per state, or,
        with `drafts` (per state), 1 + len(drafts) per state."""
        if not self.processors:
            return
        rows: dict[RowKey, tuple[int, CachedRequestState]] = {}
        for i, state in enumerate(states):
            request_drafts = drafts[i] if drafts is not None else ()
            for position in range(1 + len(request_drafts)):
                rows[(state.req_id, position)] = (len(rows), state)
                if position:
                    self._set_draft_outputs((state.req_id, position), state, request_drafts[:position])
        batch_update = self._diff(rows)
        for key in set(self._draft_outputs) - set(rows):
            del self._draft_outputs[key]
        self._rows = rows
        for processor in self.processors:
            processor.update_state(batch_update)

    def _set_draft_outputs(self, key: RowKey, state: CachedRequestState, drafts: Sequence[int]) -> None:
        outputs = self._draft_outputs.setdefault(key, [])
        outputs[:] = state.output_token_ids
        outputs.extend(drafts)

    def _diff(self, rows: dict[RowKey, tuple[int, CachedRequestState]]) -> BatchUpdate | None:
        removed: list[int] = []
        moved: list[MovedRequest] = []
        added: list[AddedRequest] = []
        for key, (old_index, old_state) in self._rows.items():
            new = rows.get(key)
            if new is None or new[1] is not old_state:  # gone, or a new request under the same id
                removed.append(old_index)
            elif new[0] != old_index:
                moved.append(MovedRequest(old_index, new[0]))
        for key, (index, state) in rows.items():
            old = self._rows.get(key)
            if old is None or old[1] is not state:
                outputs = state.output_token_ids if key[1] == 0 else self._draft_outputs[key]
                prompt = state.token_ids[: state.num_prompt_tokens]
                added.append(AddedRequest(index, state.sampling_params, prompt, outputs))
        if not (removed or moved or added):
            return None
        return BatchUpdate(batch_size=len(rows), removed=removed, moved=moved, added=added)


def apply_logits_processors(
    processors: Sequence[LogitsProcessor], logits: torch.Tensor, argmax_invariant: bool
) -> torch.Tensor:
    """`logits` through the processors of one group (argmax-invariant or not),
    in the order they were configured."""
    for processor in processors:
        if processor.is_argmax_invariant() == argmax_invariant:
            logits = processor.apply(logits)
    return logits
