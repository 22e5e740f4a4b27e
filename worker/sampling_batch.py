"""What one step samples, built once by the model runner and read by both
ways of sampling: the sampler (one token per request) and draft
verification (worker/draft_verification.py: the accepted drafts plus one).

A request samples when the step reaches the end of its known tokens. It
scores one logits row, its last scheduled position, or, with a drafter,
1 + n rows: the positions of its n drafts, then the bonus position.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from pagedllm.logits_processors.interface import LogitsProcessor
    from pagedllm.worker.persistent_batch import CachedRequestState


@dataclass(frozen=True)
class SamplingBatch:
    requests: list[CachedRequestState]  # the requests that sample, in batch order
    batch_rows: list[int]  # each one's row in the step's InputBatch
    # Each one's drafts to verify ([] for none); None: the runner has no
    # drafter, and every request scores its last position only.
    drafts: list[list[int]] | None
    logits_indices: torch.Tensor  # [R] long: the hidden-state rows scored, request after request
    # (bitmask rows, the logits rows they mask) of the grammar requests; None without.
    grammar_bitmask: tuple[torch.Tensor, list[int]] | None
    # The loaded logits processors (plugins), already told these rows.
    logits_processors: Sequence[LogitsProcessor]
    # Random rows without their own seed draw from it (the engine's seed).
    default_generator: torch.Generator
