"""The runner's requests as rows of host arrays kept across steps (vLLM's
persistent input batch).

A request gets a row when it first arrives and keeps it until it finishes:
its token ids, block table and computed-token count live in preallocated
numpy arrays, and each step only writes what changed (new block ids, the
tokens it sampled, the drafts it verifies). A step's `InputBatch` and input
ids are then gathered from the scheduled rows with a few array operations
instead of being rebuilt from per-request Python lists.

`CachedRequestState` is the runner's copy of one request across steps (its
block table and computed count are its row here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pagedllm.model_registry.input_batch import InputBatch

if TYPE_CHECKING:
    import torch

    from pagedllm.core.sampling_params import SamplingParams

# Rows to start with; the arrays double when more requests are held
# (preempted requests keep their rows, so the count can pass max_num_seqs).
_MIN_ROWS = 8


@dataclass
class CachedRequestState:
    """The runner's copy of a request; it appends the tokens it samples."""

    req_id: str
    num_prompt_tokens: int
    token_ids: list[int]  # prompt + output
    sampling_params: SamplingParams
    generator: torch.Generator | None
    eos_token_id: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # The drafter's q for the drafts it last proposed ([n, V]); None: one-hot.
    draft_probs: torch.Tensor | None = None


class PersistentBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, num_kv_cache_groups: int = 1) -> None:
        num_rows = max(_MIN_ROWS, max_num_reqs)
        self.block_size = block_size
        # NOTE: positions stay below max_model_len (the scheduler caps them),
        # but a step's accepted drafts may be sampled past it (the scheduler
        # drops them) and block tables may reach past it (draft lookahead
        # slots): both widths grow on demand.
        self.token_ids = np.zeros((num_rows, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)
        self.num_computed_tokens = np.zeros(num_rows, dtype=np.int64)
        self.block_table = np.zeros((num_rows, -(-max_model_len // block_size)), dtype=np.int32)
        self.num_blocks = np.zeros(num_rows, dtype=np.int64)
        # KV cache groups 1..: their block tables and lengths, as the two above are group 0's.
        self.other_block_tables = [np.zeros_like(self.block_table) for _ in range(num_kv_cache_groups - 1)]
        self.other_num_blocks = [np.zeros_like(self.num_blocks) for _ in range(num_kv_cache_groups - 1)]
        self.row_of: dict[str, int] = {}
        self._free_rows = list(reversed(range(num_rows)))

    # ------------------------------------------------------------- rows

    def add_request(
        self,
        req_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        num_computed: int,
        other_group_block_ids: Sequence[Sequence[int]] = (),
    ) -> None:
        if not self._free_rows:
            self._grow_rows()
        row = self._free_rows.pop()
        self.row_of[req_id] = row
        self.num_tokens[row] = 0
        self.append_token_ids(req_id, token_ids)
        self.set_block_ids(req_id, block_ids, other_group_block_ids)
        self.num_computed_tokens[row] = num_computed

    def remove_request(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self._free_rows.append(row)

    def set_num_computed_tokens(self, req_id: str, num_computed: int) -> None:
        self.num_computed_tokens[self.row_of[req_id]] = num_computed

    def append_token_ids(self, req_id: str, token_ids: Sequence[int]) -> None:
        row = self.row_of[req_id]
        start = int(self.num_tokens[row])
        self._write_tokens(row, start, token_ids)
        self.num_tokens[row] = start + len(token_ids)

    def _write_tokens(self, row: int, start: int, token_ids: Sequence[int]) -> None:
        end = start + len(token_ids)
        if end > self.token_ids.shape[1]:
            self.token_ids = np.pad(self.token_ids, ((0, 0), (0, end - self.token_ids.shape[1])))
        self.token_ids[row, start:end] = token_ids

    def set_block_ids(
        self, req_id: str, block_ids: Sequence[int], other_group_block_ids: Sequence[Sequence[int]] = ()
    ) -> None:
        """The whole block table of every group (a new or resumed request; [] when preempted)."""
        row = self.row_of[req_id]
        self.num_blocks[row] = 0
        for num_blocks in self.other_num_blocks:
            num_blocks[row] = 0
        self.append_block_ids(req_id, block_ids, other_group_block_ids)

    def append_block_ids(
        self, req_id: str, block_ids: Sequence[int], other_group_block_ids: Sequence[Sequence[int]] = ()
    ) -> None:
        row = self.row_of[req_id]
        if block_ids:
            self.block_table = _append_row(self.block_table, self.num_blocks, row, block_ids)
        for group, group_block_ids in enumerate(other_group_block_ids):
            if group_block_ids:
                self.other_block_tables[group] = _append_row(
                    self.other_block_tables[group], self.other_num_blocks[group], row, group_block_ids
                )

    def _grow_rows(self) -> None:
        num_rows = len(self.num_tokens)
        for name in ("token_ids", "num_tokens", "num_computed_tokens", "block_table", "num_blocks"):
            array = getattr(self, name)
            setattr(self, name, np.concatenate([array, np.zeros_like(array)]))
        for arrays in (self.other_block_tables, self.other_num_blocks):
            arrays[:] = [np.concatenate([array, np.zeros_like(array)]) for array in arrays]
        self._free_rows.extend(reversed(range(num_rows, 2 * num_rows)))

    # ------------------------------------------------------------- a step

    def prepare(
        self, req_ids: Sequence[str], num_scheduled_tokens: np.ndarray, drafts: Sequence[Sequence[int]]
    ) -> tuple[InputBatch, np.ndarray]:
        """This step's batch (requests in `req_ids` order) and its input ids:
        each request's next known tokens, then the drafts it verifies."""
        rows = np.fromiter((self.row_of[req_id] for req_id in req_ids), dtype=np.int64, count=len(req_ids))
        for row, request_drafts in zip(rows.tolist(), drafts, strict=True):
            if request_drafts:  # written past the known tokens; the sampled ones overwrite them
                self._write_tokens(row, int(self.num_tokens[row]), request_drafts)
        block_table = self.block_table[rows, : max(1, int(self.num_blocks[rows].max()))]
        other_block_tables = tuple(
            table[rows, : max(1, int(num_blocks[rows].max()))]
            for table, num_blocks in zip(self.other_block_tables, self.other_num_blocks, strict=True)
        )
        batch = InputBatch.from_computed(
            self.num_computed_tokens[rows], num_scheduled_tokens, block_table, self.block_size, other_block_tables
        )
        input_ids = self.token_ids[np.repeat(rows, num_scheduled_tokens), batch.positions]
        return batch, input_ids


def _append_row(table: np.ndarray, num_blocks: np.ndarray, row: int, block_ids: Sequence[int]) -> np.ndarray:
    """Append `block_ids` to `row` of a block table (widened when needed); the table."""
    start = int(num_blocks[row])
    end = start + len(block_ids)
    if end > table.shape[1]:
        table = np.pad(table, ((0, 0), (0, end - table.shape[1])))
    table[row, start:end] = block_ids
    num_blocks[row] = end
    return table
