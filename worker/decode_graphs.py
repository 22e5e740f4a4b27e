"""Graph capture for uniform decode batches (CUDA graphs on CUDA).

A decode step of n requests runs the same kernels every time, only on other
values: capture the model's forward once per batch size and replay it. The
inputs live in persistent buffers sized for the largest captured batch; a
step of n requests copies its values in, pads to the smallest captured size
>= n (padded rows write no KV: slot -1; they read one key of block 0 and
are thrown away) and replays. Prefill steps, mixed steps and steps with
speculative tokens run eagerly.

Only backends whose forward reads nothing but the metadata's device tensors
(and no host value that changes between steps) can be captured: they say so
with `AttentionBackend.supports_graph_capture(block_size)`.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagedllm.attention_backends.base import AttentionMetadata

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.model_registry.input_batch import InputBatch
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.platforms.interface import Platform


def default_graph_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, ... up to max_num_seqs, and max_num_seqs itself."""
    sizes = []
    size = 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


class DecodeGraphRunner:
    def __init__(
        self,
        model: ModelForCausalLM,
        attn_backend: type[AttentionBackend],
        platform: Platform,
        *,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.platform = platform
        self.sizes = sorted(set(sizes))
        self.max_model_len = max_model_len
        self.block_size = block_size
        max_size = self.sizes[-1]
        self.max_blocks_per_req = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(max_size, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_size, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((max_size,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_size, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_size + 1, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_size, self.max_blocks_per_req, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        self.num_replays = 0

    def _metadata(self, size: int) -> AttentionMetadata:
        # Host-side fields describe the worst case the graph must serve.
        common = AttentionMetadata(
            num_actual_tokens=size,
            num_reqs=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc_cpu=torch.arange(size + 1, dtype=torch.int32),
            seq_lens_cpu=torch.full((size,), self.max_model_len, dtype=torch.int32),
        )
        return self.attn_backend.build_metadata(common, self.block_size)

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for size in reversed(self.sizes):  # largest first: the rest fit in its memory pool
            metadata = self._metadata(size)

            def run(size: int = size, metadata: AttentionMetadata = metadata) -> torch.Tensor:
                return self.model(self.input_ids[:size], self.positions[:size], metadata)

            replay, output, pool = self.platform.capture_graph(run, pool)
            self.graphs[size] = (replay, output)

    def can_run(self, batch: InputBatch) -> bool:
        """A uniform decode batch (one token per request) of a captured size."""
        return (
            batch.num_tokens == batch.num_reqs
            and batch.num_reqs <= self.sizes[-1]
            and batch.block_table.shape[1] <= self.max_blocks_per_req
        )

    def run(self, input_ids: torch.Tensor, batch: InputBatch) -> torch.Tensor:
        """Hidden states [n, hidden] of a uniform decode step of n requests."""
        n = batch.num_reqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = batch.block_table.shape[1]
        # The step's host arrays go straight into the persistent buffers.
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(torch.from_numpy(batch.positions))
        self.slot_mapping[:n].copy_(torch.from_numpy(batch.slot_mapping))
        self.seq_lens[:n].copy_(torch.from_numpy(batch.seq_lens))
        self.block_table[:n, :width].copy_(torch.from_numpy(batch.block_table))
        self.block_table[:n, width:].zero_()
        # Padding rows: one-token requests that write nothing.
        self.input_ids[n:size].zero_()
        self.positions[n:size].zero_()
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        self.block_table[n:size].zero_()
        replay, output = self.graphs[size]
        replay()
        self.num_replays += 1
        return output[:n]
