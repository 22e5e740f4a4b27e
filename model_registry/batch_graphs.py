"""Graph capture for uniform batches: decode steps and verify steps.

A decode step of n requests runs the same kernels every time, only on other
values: capture the model's forward once per batch size and replay it. The
inputs live in persistent buffers sized for the largest captured batch; a
step of n requests copies its values in, pads to the smallest captured size
>= n (padded rows write no KV: slot -1; they read keys of block 0 and are
thrown away) and replays.

A speculative verify step, in which every request scores the same q = 1 + k
tokens (its newest token and k drafts), is as regular (vLLM captures such
uniform query-length batches too): graphs are captured per batch size and
query length, for the query lengths asked for (`query_lens`), at the sizes
whose q-token batches hold at most `max_verify_tokens` tokens (every decode
graph's batch size at the longest q, up to MAX_VERIFY_GRAPH_TOKENS), each
when a step first needs it (`capture` takes the decode graphs only). A step whose
requests score 1..q tokens (drafts of different lengths, some none) replays
the q graph too: each request's rows are padded to q at its end, padding
rows write no KV and their outputs are dropped, and the request's context
length is raised by its padding so that its real rows attend exactly as
they would unpadded (row i of q sees the context up to seq_len - (q - 1 - i)).
Rejection sampling runs after the replay, on its output. Steps with a
prefill chunk longer than q run eagerly.

Only backends whose forward reads nothing but the metadata's device tensors
(and no host value that changes between steps) can be captured: they say so
with `AttentionBackend.supports_graph_capture(block_size)`; a backend that
finds a query length it cannot serve that way refuses at capture, and those
steps run eagerly.

`BatchGraphs` captures any forward over such batches: the model runner's
(worker/decode_graphs.py) and a drafter's single-token draft steps
(spec_decode/model_drafter.py), which also read per-row inputs besides the
tokens (`extra_inputs`, EAGLE's features) and give several outputs (the
first is what the platform's capture returns; the others are tensors the
forward made, which a replay writes again).

A model with several KV cache groups (core/kv_cache/kv_cache_interface.py)
has a block table and a slot mapping per group: each is a persistent buffer
too, copied in with the step's, and each group's metadata is captured.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedllm.attention_backends.base import AttentionMetadata
from pagedllm.core.errors import GraphCaptureError

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.model_registry.input_batch import InputBatch
    from pagedllm.platforms.interface import Platform

# forward(input_ids, positions, metadata, extras) -> outputs, the first [T, ...] tensor first.
BatchForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, dict[str, torch.Tensor]],
                        tuple[torch.Tensor, ...]]

logger = logging.getLogger(__name__)

# Verify graphs hold at most this many tokens (vLLM bounds its graphs by
# tokens too, 512 by default): batch 32 with 1 + 4 tokens each (160) replays;
# larger verify batches run eagerly, where Python's share of the step is small.
MAX_VERIFY_GRAPH_TOKENS = 512


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, ... up to max_num_seqs, and max_num_seqs itself."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


class BatchGraphs:
    def __init__(
        self,
        forward: BatchForward,
        attn_backend: type[AttentionBackend],
        platform: Platform,
        *,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
        query_lens: list[int] | None = None,
        extra_inputs: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
        num_kv_cache_groups: int = 1,
    ) -> None:
        """`extra_inputs`: name -> (shape of one row, dtype) of the other
        per-row inputs `forward` reads (each a persistent buffer too)."""
        self.batch_forward = forward
        self.attn_backend = attn_backend
        self.platform = platform
        self.sizes = sorted(set(sizes))
        self.query_lens = sorted(set(query_lens or [1]) | {1})
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_size = self.sizes[-1]
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.max_verify_tokens = max(max_size, min(MAX_VERIFY_GRAPH_TOKENS, max_size * self.query_lens[-1]))
        max_tokens = max(max_size, max(size * q for q in self.query_lens for size in self.sizes
                                       if size * q <= self.max_verify_tokens))
        self.input_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_tokens,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        # Constant per query length q: request r's rows start at r * q.
        self.query_start_locs = {
            query_len: torch.arange(max_size + 1, dtype=torch.int32, device=device) * query_len
            for query_len in self.query_lens
        }
        self.block_table = torch.zeros(max_size, self.max_blocks_per_req, dtype=torch.int32, device=device)
        # KV cache groups 1..: their block tables and slot mappings.
        self.other_block_tables = [torch.zeros_like(self.block_table) for _ in range(num_kv_cache_groups - 1)]
        self.other_slot_mappings = [torch.full_like(self.slot_mapping, -1) for _ in range(num_kv_cache_groups - 1)]
        self.extras = {name: torch.zeros(max_tokens, *row, dtype=dtype, device=device)
                       for name, (row, dtype) in (extra_inputs or {}).items()}
        # (batch size, query length) -> (replay, the forward's outputs)
        self.graphs: dict[tuple[int, int], tuple[Callable[[], None], tuple[torch.Tensor, ...]]] = {}
        self.num_replays = 0
        self.num_replays_by_query_len: Counter[int] = Counter()
        self.num_padded_replays = 0  # of steps whose requests scored different numbers of tokens
        # q -> the batch sizes a graph may be captured at: every size for
        # decode steps, those whose q-token batches fit max_verify_tokens for
        # verify steps.
        self.allowed_sizes = {
            query_len: [size for size in self.sizes if size * query_len <= self.max_verify_tokens] or [1]
            for query_len in self.query_lens
        }
        self._pool: object | None = None
        # Graphs captured so far (a step that captured one took that much longer).
        self.num_captures = 0

    def sizes_for(self, query_len: int) -> list[int]:
        """The batch sizes captured so far for steps that score `query_len` tokens per request."""
        return sorted(size for size, graph_query_len in self.graphs if graph_query_len == query_len)

    def _metadata(self, size: int, query_len: int) -> AttentionMetadata:
        # Host-side fields describe the worst case the graph must serve.
        common = AttentionMetadata(
            num_actual_tokens=size * query_len,
            num_reqs=size,
            max_query_len=query_len,
            max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_locs[query_len][: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[: size * query_len],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32) * query_len,
            seq_lens_cpu=torch.full((size,), self.max_model_len, dtype=torch.int32),
        )
        metadata = self.attn_backend.build_metadata(common, self.block_size)
        if self.other_block_tables:
            metadata.kv_cache_groups = tuple(
                self.attn_backend.build_metadata(
                    dataclasses.replace(
                        common, block_table=block_table[:size], slot_mapping=slot_mapping[: size * query_len]
                    ),
                    self.block_size,
                )
                for block_table, slot_mapping in zip(self.other_block_tables, self.other_slot_mappings, strict=True)
            )
        return metadata

    @torch.inference_mode()
    def capture(self) -> None:
        """The decode graphs, now (GraphCaptureError when one cannot be
        captured). Verify graphs (q > 1) are captured when a step first
        needs one: the shapes are many (every q of 2..1 + k at every size),
        most never seen by a given workload, and capturing them all at
        start-up doubled an engine's start."""
        self._pool = self._capture_query_len(1, self.sizes, self._pool)

    def _capture_query_len(self, query_len: int, sizes: list[int], pool: object | None) -> object | None:
        for size in reversed(sizes):  # largest first: the rest fit in its memory pool
            metadata = self._metadata(size, query_len)
            num_tokens = size * query_len
            extras = {name: buffer[:num_tokens] for name, buffer in self.extras.items()}
            outputs: list[tuple[torch.Tensor, ...]] = []

            def run(num_tokens: int = num_tokens, metadata: AttentionMetadata = metadata,
                    extras: dict[str, torch.Tensor] = extras,
                    outputs: list[tuple[torch.Tensor, ...]] = outputs) -> torch.Tensor:
                outputs[:] = [self.batch_forward(self.input_ids[:num_tokens], self.positions[:num_tokens], metadata,
                                           extras)]
                return outputs[0][0]

            # NOTE: the platform runs `run` last for the recording: `outputs` holds that run's tensors.
            replay, _, pool = self.platform.capture_graph(run, pool)
            self.graphs[(size, query_len)] = (replay, outputs[0])
            self.num_captures += 1
        return pool

    def _graph_size(self, batch: InputBatch) -> tuple[int, int] | None:
        """(size, q) of the graph that serves `batch`: its requests score 1..q
        tokens each (q the most; padded to q unless all score q), a size >=
        its requests allowed for q, and every padded context length within
        the block table; else None."""
        num_reqs = batch.num_reqs
        if num_reqs == 0 or max(table.shape[1] for table in (batch.block_table, *batch.other_block_tables)) > (
            self.max_blocks_per_req
        ):
            return None
        query_len = int(batch.query_lens.max())
        sizes = self.allowed_sizes.get(query_len, [])
        index = bisect.bisect_left(sizes, num_reqs)
        if index == len(sizes):
            return None
        if batch.num_tokens != num_reqs * query_len and (
            int((batch.seq_lens - batch.query_lens).max()) + query_len > self.max_blocks_per_req * self.block_size
        ):
            return None  # a padded request would attend past its block table
        return sizes[index], query_len

    def can_run(self, batch: InputBatch) -> bool:
        """A uniform batch (one token per request, or the same 1 + k) of a
        shape captured, or captured now (a verify shape's first step); a
        query length the backend cannot serve from tensors alone is given
        up as a whole (its steps run eagerly), logged."""
        shape = self._graph_size(batch)
        if shape is None:
            return False
        if shape not in self.graphs:
            size, query_len = shape
            self._idle_inputs(0, size, query_len)
            try:
                with torch.inference_mode():
                    self._pool = self._capture_query_len(query_len, [size], self._pool)
            except GraphCaptureError as error:
                self.allowed_sizes.pop(query_len, None)
                logger.info("graphs of %d tokens per request: off, those steps run eagerly (%s)", query_len, error)
                return False
        return True

    def _idle_inputs(self, first: int, end: int, query_len: int) -> None:
        """Requests first..end - 1 of q tokens each as idle rows: they write
        no KV (slot -1) and read block 0 only. Padding rows are such; so is
        a whole batch a graph is captured on between two steps (the buffers
        still hold the last step's slots: the capture must not write there)."""
        tokens = slice(first * query_len, end * query_len)
        self.input_ids[tokens].zero_()
        self.positions[tokens].zero_()
        self.slot_mapping[tokens].fill_(-1)
        self.seq_lens[first:end].fill_(query_len)
        self.block_table[first:end].zero_()
        for block_table, slot_mapping in zip(self.other_block_tables, self.other_slot_mappings, strict=True):
            block_table[first:end].zero_()
            slot_mapping[tokens].fill_(-1)
        for buffer in self.extras.values():
            buffer[tokens].zero_()

    def run(self, input_ids: torch.Tensor, batch: InputBatch,
            extras: dict[str, torch.Tensor] | None = None) -> tuple[torch.Tensor, ...]:
        """The forward's outputs, first rows [n * q] of each, for a uniform
        step of n requests (`extras`: a value per row of each extra input)."""
        shape = self._graph_size(batch)
        assert shape is not None, "run() without can_run()"
        size, query_len = shape
        n, num_tokens = batch.num_reqs, batch.num_tokens
        if num_tokens == n * query_len:
            self._copy_inputs(input_ids, batch, extras)
            rows = None
        else:
            rows = self._copy_padded_inputs(input_ids, batch, query_len, extras)
        self._idle_inputs(n, size, query_len)  # the padding requests
        replay, outputs = self.graphs[(size, query_len)]
        replay()
        self.num_replays += 1
        self.num_replays_by_query_len[query_len] += 1
        if rows is None:
            return tuple(output[:num_tokens] for output in outputs)
        self.num_padded_replays += 1
        return tuple(output.index_select(0, rows) for output in outputs)

    def _copy_inputs(self, input_ids: torch.Tensor, batch: InputBatch,
                     extras: dict[str, torch.Tensor] | None) -> None:
        """The step's host arrays, straight into the persistent buffers."""
        num_tokens = batch.num_tokens
        self.input_ids[:num_tokens].copy_(input_ids)
        self.positions[:num_tokens].copy_(torch.from_numpy(batch.positions))
        self.slot_mapping[:num_tokens].copy_(torch.from_numpy(batch.slot_mapping))
        for slot_mapping, group_slots in zip(self.other_slot_mappings, batch.other_slot_mappings, strict=True):
            slot_mapping[:num_tokens].copy_(torch.from_numpy(group_slots))
        self._copy_requests(batch, batch.seq_lens)
        for name, values in (extras or {}).items():
            self.extras[name][:num_tokens].copy_(values)

    def _copy_padded_inputs(self, input_ids: torch.Tensor, batch: InputBatch, query_len: int,
                            extras: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """Request r's rows into graph rows r * q + 0.. (the rest of its q
        idle), its context length raised by its padding; returns the graph
        row of each of the step's rows."""
        n = batch.num_reqs
        query_lens = batch.query_lens
        starts = np.repeat(batch.query_start_loc[:-1], query_lens)
        rows = torch.from_numpy(np.repeat(np.arange(n) * query_len, query_lens) + np.arange(batch.num_tokens) - starts)
        rows = rows.to(self.input_ids.device)
        self._idle_inputs(0, n, query_len)
        self.input_ids.index_copy_(0, rows, input_ids)
        self.positions.index_copy_(0, rows, torch.from_numpy(batch.positions).to(self.positions.device))
        self.slot_mapping.index_copy_(0, rows, torch.from_numpy(batch.slot_mapping).to(self.slot_mapping.device))
        for slot_mapping, group_slots in zip(self.other_slot_mappings, batch.other_slot_mappings, strict=True):
            slot_mapping.index_copy_(0, rows, torch.from_numpy(group_slots).to(slot_mapping.device))
        self._copy_requests(batch, batch.seq_lens + (query_len - query_lens))
        for name, values in (extras or {}).items():
            self.extras[name].index_copy_(0, rows, values)
        return rows

    def _copy_requests(self, batch: InputBatch, seq_lens: np.ndarray) -> None:
        """The step's requests' context lengths and block tables (every group's)."""
        n = batch.num_reqs
        self.seq_lens[:n].copy_(torch.from_numpy(seq_lens))
        for buffer, block_table in zip(
            (self.block_table, *self.other_block_tables), (batch.block_table, *batch.other_block_tables), strict=True
        ):
            width = block_table.shape[1]
            buffer[:n, :width].copy_(torch.from_numpy(block_table))
            buffer[:n, width:].zero_()
