"""What the scheduler tells the model runner each step, and what comes back.

The runner keeps its own copy of every request's tokens (it samples them), so
the scheduler sends a request's prompt once and afterwards only what changed:
new block ids and the number of tokens already computed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    import torch

    from pagedllm.core.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the runner has not seen yet."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None


@dataclass
class CachedRequestData:
    """A request the runner already holds."""

    req_id: str
    # Appended to the runner's block table; the whole table when resumed.
    new_block_ids: list[int]
    num_computed_tokens: int
    # Back after recompute preemption: its block table starts over.
    resumed_from_preemption: bool = False


@dataclass
class KVConnectorMetadata:
    """What a KV connector's scheduler side hands its worker side for one
    step (blocks to load, save, spill); each connector subclasses it. It rides
    on SchedulerOutput, hence lives here (kv_connectors.base re-exports it)."""


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step (prompt chunk, 1 decode token,
    # or 1 + len(draft tokens)); insertion order is the batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> draft tokens to verify this step (speculative decoding).
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests that sample this step under a grammar (structured output), in
    # batch order; each owns 1 + len(its drafts) consecutive grammar_bitmask rows.
    structured_output_request_ids: list[str] = field(default_factory=list)
    # int32 [rows, ceil(vocab_size / 32)] on the CPU, bit set = token allowed
    # (structured_output/interface.py); None when no request needs one.
    # NOTE: a view of a buffer the next schedule() overwrites: use it this step.
    grammar_bitmask: torch.Tensor | None = None
    # Requests the runner must forget (finished or aborted since last step).
    finished_req_ids: set[str] = field(default_factory=set)
    # Requests preempted this step: the runner drops their blocks but keeps
    # their tokens and RNG state for the resume.
    preempted_req_ids: set[str] = field(default_factory=set)
    # The KV connector's instructions for this step (loads, saves, spills);
    # None without a connector.
    kv_connector_metadata: KVConnectorMetadata | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class LogprobEntry(NamedTuple):
    """Logprobs at one position: index 0 is the chosen token, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # 1-based rank of the chosen token


@dataclass
class ModelRunnerOutput:
    # req_id -> tokens sampled this step (empty for a partial prefill chunk).
    sampled_token_ids: dict[str, list[int]]
    # req_id -> one entry per sampled token, for requests that asked.
    logprobs: dict[str, list[LogprobEntry]] = field(default_factory=dict)
    # req_id -> entries for the prompt positions computed this step
    # (None for the very first prompt token, which has no logprob).
    prompt_logprobs: dict[str, list[LogprobEntry | None]] = field(default_factory=dict)
    # req_id -> draft tokens the drafter proposed for the next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
