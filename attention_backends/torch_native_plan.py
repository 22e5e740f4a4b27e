"""The cpu backend's plan of one flattened batch (torch_native.py): which
token goes to which padded query row, which cache slots hold each request's
keys, the causal mask, the decode kernel's rows. Built once per forward by
`TorchNativeBackend.build_metadata` and reused by every layer, per-head
(torch_native.py) and latent (torch_mla.py) alike.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pagedllm.attention_backends.base import AttentionMetadata


@dataclass
class RequestGroup:
    """Requests attended together: queries padded to [B, max_query_len].

    The gather path's index tensors (key slots, positions, masks) are built
    on first use: a decode group the CPU decode kernel serves never needs
    them, and building them was most of a small model's per-step plan time.
    """

    num_reqs: int
    max_query_len: int
    max_seq_len: int
    # Rows of the flattened batch this group owns, in (request, i) order;
    # None when the group is the whole batch in order.
    token_rows: torch.Tensor | None
    # Row of each owned token in the padded [B * max_query_len] layout; None
    # when that layout is the flattened one (pure decode).
    padded_rows: torch.Tensor | None
    req_block_table: torch.Tensor  # [B, W], the block table's rows (its dtype, on its device)
    req_seq_lens: torch.Tensor  # int64 [B], CPU
    query_lens: torch.Tensor  # int64 [B], CPU
    block_size: int
    # Pure decode groups: the requests' block table rows (int32 [B, W]) and
    # context lengths (int32 [B]), for the CPU decode kernel.
    block_table: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    _masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    @functools.cached_property
    def key_pos(self) -> torch.Tensor:  # int64 [max_seq_len]
        return torch.arange(self.max_seq_len, device=self.req_block_table.device)

    @functools.cached_property
    def query_pos(self) -> torch.Tensor:
        """int64 [B, max_query_len]; padded rows clamped to the last position."""
        # NOTE: a padded query row gets the request's last position so that it
        # attends to at least one real key (a fully masked row would be NaN).
        seq_lens, query_lens = self.req_seq_lens[:, None], self.query_lens[:, None]
        offsets = torch.arange(self.max_query_len)[None, :]
        return torch.minimum(seq_lens - query_lens + offsets, seq_lens - 1).to(self.req_block_table.device)

    @functools.cached_property
    def key_slots(self) -> torch.Tensor:
        """int64 [B, max_seq_len], the flat cache slot of each key position."""
        device, block_size = self.req_block_table.device, self.block_size
        key_pos = torch.arange(self.max_seq_len)
        block_cols = (key_pos // block_size).clamp(max=self.req_block_table.shape[1] - 1)
        block_ids = self.req_block_table.long()[:, block_cols.to(device)]
        key_slots = block_ids * block_size + (key_pos % block_size).to(device)
        # NOTE: key positions past a request's length may name unwritten (even
        # NaN) memory; point them at the request's first key, which is always
        # written, so that masked-out values stay finite (0 * NaN = NaN).
        is_real_key = (key_pos[None, :] < self.req_seq_lens[:, None]).to(device)
        return torch.where(is_real_key, key_slots, key_slots[:, :1])

    @property
    def flat_key_slots(self) -> torch.Tensor:
        return self.key_slots.view(-1)

    def mask(self, sliding_window: int | None) -> torch.Tensor:
        """bool [B, 1, max_query_len, max_seq_len]; True = attend."""
        cached = self._masks.get(sliding_window)
        if cached is not None:
            return cached
        query_pos = self.query_pos[:, :, None]
        key_pos = self.key_pos[None, None, :]
        mask = key_pos <= query_pos
        if sliding_window is not None:
            mask &= key_pos > query_pos - sliding_window
        mask = mask.unsqueeze(1)
        self._masks[sliding_window] = mask
        return mask


@dataclass
class TorchNativeBatchPlan:
    """Index tensors for one flattened batch, shared by all layers."""

    block_size: int
    num_actual_tokens: int
    # Tokens whose slot is -1 are not written; None = every token is written.
    write_rows: torch.Tensor | None
    write_slots: torch.Tensor  # int64, one per written token
    slot_mapping: torch.Tensor  # int64, one per token (-1: not written), the metadata's own tensor where it is one
    # Decodes in one group (the CPU decode kernel reads each request's own
    # keys, whatever the lengths), then the prefill chunks with context.
    groups: list[RequestGroup]
    # Fresh prefills' rows of the flattened batch: [start, end) per request.
    fresh_prefill_rows: list[tuple[int, int]] = field(default_factory=list)
    # Builds `groups` with the decodes split by length (split_by_length), for
    # layers that gather and pad the keys instead; None: the same as `groups`.
    _build_gather_groups: Callable[[], list[RequestGroup]] | None = None
    # Every request scores this many (2..MAX_UNIFORM_QUERY_LEN) tokens over a
    # cached context: the decode kernel serves them all in one call (None: no).
    uniform_query_len: int | None = None

    @functools.cached_property
    def fresh_prefill_bounds(self) -> torch.Tensor:
        """int64 [R, 2], CPU: `fresh_prefill_rows` for the CPU prefill kernel."""
        return torch.tensor(self.fresh_prefill_rows, dtype=torch.int64).view(-1, 2)

    @functools.cached_property
    def max_fresh_prefill_len(self) -> int:
        return max((end - start for start, end in self.fresh_prefill_rows), default=0)

    @functools.cached_property
    def gather_groups(self) -> list[RequestGroup]:
        return self.groups if self._build_gather_groups is None else self._build_gather_groups()


def _build_group(
    req_ids: torch.Tensor,
    query_start_loc_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    attn_metadata: AttentionMetadata,
    block_size: int,
    whole_batch: bool,
) -> RequestGroup:
    block_table = attn_metadata.block_table
    device = block_table.device
    query_lens = (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).long()[req_ids]
    seq_lens = seq_lens_cpu.long()[req_ids]
    num_reqs = int(req_ids.numel())
    max_query_len = int(query_lens.max())
    is_pure_decode = max_query_len == 1
    token_rows = padded_rows = None
    if not whole_batch or not is_pure_decode:
        offsets = torch.arange(max_query_len)
        is_real_query = offsets[None, :] < query_lens[:, None]  # [B, max_q]
        query_starts = query_start_loc_cpu[:-1].long()[req_ids]
        token_rows = (query_starts[:, None] + offsets[None, :])[is_real_query]
        padded_rows = (torch.arange(num_reqs)[:, None] * max_query_len + offsets[None, :])[is_real_query]
    req_block_table = block_table[req_ids.to(device)]  # [B, W]
    kernel_rows = _decode_kernel_rows(attn_metadata, req_ids, whole_batch) if is_pure_decode else None
    return RequestGroup(
        num_reqs=num_reqs,
        max_query_len=max_query_len,
        max_seq_len=int(seq_lens.max()),
        token_rows=None if whole_batch or token_rows is None else token_rows.to(device),
        padded_rows=None if is_pure_decode or padded_rows is None else padded_rows.to(device),
        req_block_table=req_block_table,
        req_seq_lens=seq_lens,
        query_lens=query_lens,
        block_size=block_size,
        block_table=kernel_rows[0] if kernel_rows else None,
        seq_lens=kernel_rows[1] if kernel_rows else None,
    )


def _decode_kernel_rows(attn_metadata: AttentionMetadata, req_ids: torch.Tensor, whole_batch: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decode group's block table rows and lengths as the CPU decode
    kernel reads them (int32, rows contiguous). For the whole batch they are
    the metadata's own tensors where those already are so, read when a layer
    runs: a captured decode graph (worker/decode_graphs.py) replays on the
    values its persistent buffers hold then, not on copies made at capture."""
    rows: slice | torch.Tensor = slice(0, attn_metadata.num_reqs)
    if not whole_batch:
        rows = req_ids.to(attn_metadata.block_table.device)
    block_table, seq_lens = attn_metadata.block_table[rows], attn_metadata.seq_lens[rows]
    if block_table.dtype != torch.int32 or block_table.stride(-1) != 1:
        block_table = block_table.to(torch.int32).contiguous()
    return block_table, seq_lens.to(torch.int32).contiguous()


# Decodes are split in two groups by context length when that cuts the keys
# gathered and attended (each padded to its group's longest) by this much:
# a second group costs one more gather and SDPA call per layer.
MIN_PADDING_SAVING = 0.25


def split_by_length(req_ids: torch.Tensor, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    """`req_ids` as one group, or two (shorter, longer contexts) when padding
    each to its own longest saves MIN_PADDING_SAVING of the padded keys."""
    if req_ids.numel() < 2:
        return [req_ids]
    lens, order = seq_lens[req_ids].long().sort()
    num_reqs = lens.numel()
    # Splitting before sorted index i: i requests padded to lens[i - 1], the rest to the longest.
    split_at = torch.arange(1, num_reqs)
    padded = split_at * lens[:-1] + (num_reqs - split_at) * lens[-1]
    best = int(padded.argmin())
    if float(padded[best]) > (1 - MIN_PADDING_SAVING) * num_reqs * float(lens[-1]):
        return [req_ids]
    # Each group keeps batch order (rows are gathered per group anyway).
    first = order[: best + 1].sort().values
    second = order[best + 1 :].sort().values
    return [req_ids[first], req_ids[second]]


def build_batch_plan(attn_metadata: AttentionMetadata, block_size: int) -> TorchNativeBatchPlan:
    """Compute the per-batch index tensors (once per forward, not per layer)."""
    num_tokens = attn_metadata.num_actual_tokens
    slot_mapping = attn_metadata.slot_mapping[:num_tokens].long()
    is_written = slot_mapping >= 0
    if bool(is_written.all()):
        write_rows, write_slots = None, slot_mapping
    else:
        write_rows = is_written.nonzero().squeeze(1)
        write_slots = slot_mapping[write_rows]

    query_start_loc_cpu = attn_metadata.query_start_loc_cpu[: attn_metadata.num_reqs + 1]
    seq_lens_cpu = attn_metadata.seq_lens_cpu[: attn_metadata.num_reqs]
    query_lens = query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]
    is_decode = query_lens == 1
    # A fresh prefill attends over its own rows' K/V, not the cache: only when
    # every row is written (a row with slot -1 is not in the cache to attend to).
    is_fresh_prefill = ~is_decode & (query_lens == seq_lens_cpu) & (write_rows is None)
    fresh_ids = is_fresh_prefill.nonzero().squeeze(1)
    fresh_prefill_rows = list(zip(query_start_loc_cpu[fresh_ids].tolist(), query_start_loc_cpu[fresh_ids + 1].tolist(),
                                  strict=True))
    chunks = (~is_decode & ~is_fresh_prefill).nonzero().squeeze(1)
    decodes = is_decode.nonzero().squeeze(1)

    def build_groups(decode_groups: list[torch.Tensor]) -> list[RequestGroup]:
        kinds = [ids for ids in (*decode_groups, chunks) if ids.numel()]
        whole_batch = len(kinds) == 1 and not fresh_prefill_rows
        return [_build_group(ids, query_start_loc_cpu, seq_lens_cpu, attn_metadata, block_size, whole_batch)
                for ids in kinds]

    def build_gather_groups() -> list[RequestGroup]:
        split = split_by_length(decodes, seq_lens_cpu)
        return groups if len(split) == 1 else build_groups(split)

    groups = build_groups([decodes])
    return TorchNativeBatchPlan(block_size, num_tokens, write_rows, write_slots, slot_mapping, groups,
                                fresh_prefill_rows, build_gather_groups if decodes.numel() > 1 else None,
                                _uniform_query_len(query_lens, seq_lens_cpu))


# The most tokens per request the decode kernel serves in one call per layer
# (at most its MAX_QUERY_LEN): verify steps of up to 15 drafts.
MAX_UNIFORM_QUERY_LEN = 16


def _uniform_query_len(query_lens: torch.Tensor, seq_lens: torch.Tensor) -> int | None:
    """q when every request scores q (2..MAX_UNIFORM_QUERY_LEN) tokens over
    a cached context, else None."""
    if query_lens.numel() == 0:
        return None
    query_len = int(query_lens[0])
    if not 1 < query_len <= MAX_UNIFORM_QUERY_LEN or not bool((query_lens == query_len).all()):
        return None
    return query_len if bool((seq_lens > query_len).all()) else None


@dataclass
class TorchNativeMetadata(AttentionMetadata):
    """The common metadata plus this backend's plan for the batch."""

    plan: TorchNativeBatchPlan | None = None
