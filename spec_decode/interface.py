"""The drafter plugin kind: propose up to k tokens per request for a batch.

The model runner calls `Drafter.propose` after every step that sampled, with
each sampling request's tokens (prompt + output, this step's tokens included)
and a view of the target's forward pass (`TargetStep`) for drafters that run
a model over the same tokens. The drafts go back to the scheduler
(`Request.spec_token_ids`); the next step scores them all at once and the
rejection sampler keeps the accepted prefix.

A drafter registers through the `register_drafters` hook under the name
`speculative.method` selects, and is built as `DrafterCls(config, context)`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import numpy as np
    import torch

    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.core.config import SpeculativeConfig
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.platforms.interface import Platform


@dataclass
class DrafterContext:
    """What the engine knows that a drafter may need to build itself."""

    target_model: torch.nn.Module
    attn_backend: type[AttentionBackend]
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_model_len: int
    # The target's paged KV pool: a model drafter allocates its own cache with
    # the same geometry and addresses it by the same block tables.
    num_blocks: int
    block_size: int
    # What the target's KV cache stores (cache.cache_dtype resolved); a model
    # drafter's own cache uses it too. None (a context built by a plugin for
    # API 1.x): `dtype`.
    kv_cache_dtype: torch.dtype | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        """The dtype a drafter's own KV cache is allocated in."""
        return self.kv_cache_dtype or self.dtype


@dataclass
class TargetStep:
    """The target's forward pass of this step, row for row (the runner's
    flattened batch), and what the rejection sampler kept."""

    req_ids: list[str]  # every scheduled request, batch order
    input_ids: torch.Tensor  # [T] long
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int64
    block_table: np.ndarray  # [B, max_blocks] int32
    # The target's last hidden states (after the final norm), [T, hidden].
    hidden_states: torch.Tensor
    # Rejected draft rows at the end of each request's rows (0 without drafts).
    num_rejected: np.ndarray  # [B] int64
    # The token after each request's last kept row: the newest sampled token,
    # or the next prompt token after a prefill chunk (EAGLE's shifted input).
    next_token_ids: np.ndarray  # [B] int64
    # The hidden states entering the layers a drafter asked the target to
    # keep (EAGLE-3), [T, n * hidden]; None when none were asked for.
    aux_hidden_states: torch.Tensor | None = None


@dataclass
class DraftInputs:
    """The requests to draft for (they sampled this step), in batch order."""

    req_ids: list[str]
    # Prompt + output of each request, including the tokens sampled this step.
    token_ids: list[list[int]]
    sampling_params: list[SamplingParams]
    # Row of each request in `target_step` (None when the drafter is called
    # outside a step, e.g. in tests of a drafter that needs no model).
    batch_rows: list[int] = field(default_factory=list)
    target_step: TargetStep | None = None
    # Per request, how many drafts the speculation policy keeps (at most
    # num_speculative_tokens; empty: all k). A drafter may propose no more
    # than that; the runner cuts longer proposals.
    num_drafts: list[int] = field(default_factory=list)


@dataclass
class DraftOutput:
    # Up to k drafts per request (an empty list: nothing to propose).
    draft_token_ids: list[list[int]]
    # Per request, the draft distribution q at each draft, float [n_i, V];
    # None (or a None entry) means the drafts were chosen deterministically
    # and q is one-hot.
    draft_probs: list[torch.Tensor | None] | None = None


class Drafter(ABC):
    """Proposes draft tokens; never changes what the target would produce."""

    # Whether the drafter writes KV at positions past the scheduled tokens
    # (it runs a model over its own drafts): the scheduler then reserves
    # num_speculative_tokens lookahead slots per request.
    needs_lookahead_slots: ClassVar[bool] = False

    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        self.config = config
        self.context = context
        self.num_speculative_tokens = config.num_speculative_tokens

    @classmethod
    def kv_cache_bytes_per_block(cls, config: SpeculativeConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of the drafter's own KV cache per target block on this rank,
        `dtype` being the KV cache's (`DrafterContext.cache_dtype`)
        (0: none; at tensor_parallel_size > 1 only this rank's KV heads, read
        from `get_tp_group()`, which the Worker has joined when it asks);
        the engine sizes the shared block pool with it."""
        return 0

    def capture_graphs(self, platform: Platform, sizes: list[int]) -> None:  # noqa: B027 - optional: no model
        """Capture the drafter's forwards as graphs for these batch sizes
        (called once, after its layers are bound to the platform's ops, when
        the engine captures graphs at all). Default: nothing to capture.
        A forward that cannot be captured should run eagerly, logged."""

    @abstractmethod
    def propose(self, inputs: DraftInputs) -> DraftOutput:
        """Up to `num_speculative_tokens` drafts for each request of `inputs`."""

    def finish_requests(self, req_ids: set[str]) -> None:  # noqa: B027 - optional hook, default no-op
        """These requests finished or were aborted: drop what is kept for them.

        The model runner calls it before the step that follows (the ids the
        scheduler freed); ids the drafter never saw may be among them.
        Default: nothing (a stateless drafter). Plugin API >= 1.10."""
