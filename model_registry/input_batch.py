"""One flattened forward batch, described once on the host.

Every forward over the paged KV cache -- the target's step, a model drafter's
catch-up and draft steps, the profile run, a replayed decode graph -- is the
same kind of batch: B requests, request r owning the rows
``query_start_loc[r]:query_start_loc[r + 1]`` at consecutive positions that end
at its context length ``seq_lens[r]``, each row writing its KV at
``slot_mapping`` through the request's block table. `InputBatch` holds those
numpy arrays and is the one place that turns them into device tensors and
`AttentionMetadata`. It sits with the models because every forward takes
it, the drafters' own (spec_decode/) included.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention_backends.base import AttentionMetadata

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend


@dataclass(frozen=True)
class InputBatch:
    query_start_loc: np.ndarray  # [B + 1] int64
    seq_lens: np.ndarray  # [B] int64: context length after this forward
    positions: np.ndarray  # [T] int64
    block_table: np.ndarray  # [B, max_num_blocks] int32
    slot_mapping: np.ndarray  # [T] int64: block_id * block_size + offset
    # KV cache groups 1.. (core/kv_cache/kv_cache_interface.py): each
    # group's block table and slot mapping, as the two above are group 0's.
    other_block_tables: tuple[np.ndarray, ...] = ()
    other_slot_mappings: tuple[np.ndarray, ...] = ()

    @classmethod
    def from_positions(
        cls,
        positions: np.ndarray,
        query_lens: np.ndarray,
        block_table: np.ndarray,
        block_size: int,
        other_block_tables: tuple[np.ndarray, ...] = (),
    ) -> InputBatch:
        """Request r has query_lens[r] >= 1 rows, in order, at consecutive
        positions ending at its context length."""
        num_reqs = len(query_lens)
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start_loc[1:])
        req_index = np.repeat(np.arange(num_reqs), query_lens)
        block_cols, offsets = positions // block_size, positions % block_size
        slot_mapping = block_table[req_index, block_cols].astype(np.int64) * block_size + offsets
        return cls(
            query_start_loc=query_start_loc,
            seq_lens=positions[query_start_loc[1:] - 1] + 1,
            positions=positions,
            block_table=np.ascontiguousarray(block_table),
            slot_mapping=slot_mapping,
            other_block_tables=tuple(np.ascontiguousarray(table) for table in other_block_tables),
            other_slot_mappings=tuple(
                table[req_index, block_cols].astype(np.int64) * block_size + offsets for table in other_block_tables
            ),
        )

    @classmethod
    def from_computed(
        cls,
        num_computed_tokens: np.ndarray,
        num_scheduled_tokens: np.ndarray,
        block_table: np.ndarray,
        block_size: int,
        other_block_tables: tuple[np.ndarray, ...] = (),
    ) -> InputBatch:
        """Request r computes num_scheduled_tokens[r] tokens after its first
        num_computed_tokens[r] (the scheduler's view of a step)."""
        num_reqs = len(num_scheduled_tokens)
        req_index = np.repeat(np.arange(num_reqs), num_scheduled_tokens)
        first_row = np.cumsum(num_scheduled_tokens) - num_scheduled_tokens
        # positions[t] = num_computed[r] + (t - first row of r) for token t of request r
        positions = num_computed_tokens[req_index] + np.arange(len(req_index)) - first_row[req_index]
        return cls.from_positions(
            positions.astype(np.int64), num_scheduled_tokens, block_table, block_size, other_block_tables
        )

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> np.ndarray:  # [B] int64
        return np.diff(self.query_start_loc)

    @property
    def num_computed_tokens(self) -> np.ndarray:  # [B] int64: context before this forward
        return self.seq_lens - self.query_lens

    def attn_metadata(self, device: torch.device) -> AttentionMetadata:
        """The backend-independent metadata of KV cache group 0, device tensors on `device`."""
        query_start_loc_cpu = torch.from_numpy(self.query_start_loc.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(self.seq_lens.astype(np.int32))
        return AttentionMetadata(
            num_actual_tokens=self.num_tokens,
            num_reqs=self.num_reqs,
            max_query_len=int(self.query_lens.max()),
            max_seq_len=int(self.seq_lens.max()),
            query_start_loc=query_start_loc_cpu.to(device),
            seq_lens=seq_lens_cpu.to(device),
            block_table=torch.from_numpy(self.block_table).to(device),
            slot_mapping=torch.from_numpy(self.slot_mapping).to(device),
            query_start_loc_cpu=query_start_loc_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )

    def to_device(
        self, attn_backend: type[AttentionBackend], block_size: int, device: torch.device
    ) -> tuple[torch.Tensor, AttentionMetadata]:
        """(positions [T] long, the backend's metadata): what a model's forward
        takes besides its input ids."""
        positions = torch.from_numpy(self.positions).to(device)
        # Backend-specific per-batch work, once for all layers (of a group).
        common = self.attn_metadata(device)
        metadata = attn_backend.build_metadata(common, block_size)
        if self.other_block_tables:
            metadata.kv_cache_groups = self._other_group_metadata(common, attn_backend, block_size, device)
        return positions, metadata

    def _other_group_metadata(
        self, common: AttentionMetadata, attn_backend: type[AttentionBackend], block_size: int, device: torch.device
    ) -> tuple[AttentionMetadata, ...]:
        """Groups 1..: group 0's batch over each group's block table."""
        return tuple(
            attn_backend.build_metadata(
                dataclasses.replace(
                    common,
                    block_table=torch.from_numpy(block_table).to(device),
                    slot_mapping=torch.from_numpy(slot_mapping).to(device),
                ),
                block_size,
            )
            for block_table, slot_mapping in zip(self.other_block_tables, self.other_slot_mappings, strict=True)
        )

