"""What the scheduler tells the model runner each step, and what comes back.

The runner keeps its own copy of every request's tokens (it samples them), so
the scheduler sends a request's prompt once and afterwards only what changed:
new block ids and the number of tokens already computed.

SchedulerOutput and ModelRunnerOutput are msgspec Structs: a multi-rank
executor sends them to its ranks and back as themselves
(executors/messages.py holds the codec: the grammar bitmask as a msgpack
extension, the KV connector's metadata decoded into the rank's connector's
`metadata_cls`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from pagedllm.core.custom_stats import FigureValue
from pagedllm.core.lora import LoRARef, LoRASlotLoad
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.step_cost import StepShape

if TYPE_CHECKING:
    from torch import Tensor
else:
    # NOTE: the core does not import torch; msgspec resolves this annotation
    # at run time, where a tensor is whatever the codec's ext hook makes.
    Tensor = Any


# A draft the scheduler reserves a slot for without knowing it (async scheduling).
DRAFT_PLACEHOLDER = -1


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the runner has not seen yet."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None = None
    # KV cache groups 1.. (core/kv_cache/kv_cache_interface.py): their block
    # tables, as `block_ids` is group 0's; empty with one group.
    other_group_block_ids: list[list[int]] = []
    # Its LoRA adapter (None: the base model); the runner finds the adapter's
    # slot from the slot loads it has applied (`SchedulerOutput.lora_loads`).
    lora: LoRARef | None = None


class CachedRequestData(msgspec.Struct, array_like=True):
    """A request the runner already holds."""

    req_id: str
    # Appended to the runner's block table; the whole table when resumed.
    new_block_ids: list[int]
    num_computed_tokens: int
    # Back after recompute preemption: its block table starts over.
    resumed_from_preemption: bool = False
    # Async scheduling: tokens of this request's step in flight, which the
    # scheduler had not seen when it scheduled this one. num_computed_tokens
    # counts every draft of that step as accepted; the runner, which knows
    # how many were, subtracts the rest (worker/draft_placeholders.py).
    num_output_placeholders: int = 0
    # KV cache groups 1..: their new block ids, as `new_block_ids` group 0's.
    other_group_block_ids: list[list[int]] = []


class KVConnectorMetadata:
    """What a KV connector's scheduler side hands its worker side for one
    step (blocks to load, save, spill); each connector subclasses it as a
    dataclass of plain data. It rides on SchedulerOutput, hence lives here
    (kv_connectors.base re-exports it).

    NOTE: not itself a dataclass, so msgspec treats the field's type as a
    custom type: a rank decodes it through its decoder's hook, into its own
    connector's `metadata_cls` (executors/messages.py)."""


@dataclass
class KVConnectorStats:
    """Cumulative counters (the engine reports deltas)."""

    # Prompt tokens looked up past the local prefix-cache hit, and found.
    external_queries: int = 0
    external_hits: int = 0
    # The connector's own tiers, by name: hits/misses (blocks) and bytes moved.
    tier_hits: dict[str, int] = field(default_factory=dict)
    tier_misses: dict[str, int] = field(default_factory=dict)
    tier_bytes_saved: dict[str, int] = field(default_factory=dict)
    tier_bytes_loaded: dict[str, int] = field(default_factory=dict)
    load_failures: int = 0

    def count(self, table: str, tier: str, amount: int = 1) -> None:
        counts: dict[str, int] = getattr(self, table)
        counts[tier] = counts.get(tier, 0) + amount

    def copy(self) -> KVConnectorStats:
        return KVConnectorStats(
            self.external_queries, self.external_hits, dict(self.tier_hits), dict(self.tier_misses),
            dict(self.tier_bytes_saved), dict(self.tier_bytes_loaded), self.load_failures,
        )

    def add(self, other: KVConnectorStats) -> None:
        """Count `other`'s counts here too (another rank's, a later step's)."""
        self.external_queries += other.external_queries
        self.external_hits += other.external_hits
        for table in ("tier_hits", "tier_misses", "tier_bytes_saved", "tier_bytes_loaded"):
            for tier, amount in getattr(other, table).items():
                self.count(table, tier, amount)
        self.load_failures += other.load_failures

    def minus(self, earlier: KVConnectorStats) -> KVConnectorStats:
        """The counts since `earlier` (a copy taken before)."""

        def diff(now: dict[str, int], then: dict[str, int]) -> dict[str, int]:
            return {tier: count - then.get(tier, 0) for tier, count in now.items() if count != then.get(tier, 0)}

        return KVConnectorStats(
            self.external_queries - earlier.external_queries,
            self.external_hits - earlier.external_hits,
            diff(self.tier_hits, earlier.tier_hits),
            diff(self.tier_misses, earlier.tier_misses),
            diff(self.tier_bytes_saved, earlier.tier_bytes_saved),
            diff(self.tier_bytes_loaded, earlier.tier_bytes_loaded),
            self.load_failures - earlier.load_failures,
        )


@dataclass
class KVConnectorOutput:
    """What a worker side reports after a step (ModelRunnerOutput carries
    it; a multi-rank executor merges the ranks'): `get_finished`'s answer and
    the worker side's counts (loaded, saved) since its last report."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    stats: KVConnectorStats | None = None


class SchedulerOutput(msgspec.Struct, array_like=True):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # req_id -> tokens to compute this step (prompt chunk, 1 decode token,
    # or 1 + len(draft tokens)); insertion order is the batch order.
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # req_id -> draft tokens to verify this step (speculative decoding). With
    # async scheduling a request scheduled before its last step's output was
    # seen gets DRAFT_PLACEHOLDER entries: the runner verifies in their place
    # the drafts it proposed at the end of that step (fewer, or none, is fine).
    scheduled_spec_decode_tokens: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # Requests that sample this step under a grammar (structured output), in
    # batch order; each owns 1 + len(its drafts) consecutive grammar_bitmask rows.
    structured_output_request_ids: list[str] = msgspec.field(default_factory=list)
    # int32 [rows, ceil(vocab_size / 32)] on the CPU, bit set = token allowed
    # (structured_output/interface.py); None when no request needs one.
    # NOTE: a view of a buffer the next schedule() overwrites: use it this step
    # (a step with a bitmask is `sync_required`, so async scheduling waits for it).
    grammar_bitmask: Tensor | None = None
    # Requests the runner must forget (finished or aborted since last step).
    finished_req_ids: set[str] = msgspec.field(default_factory=set)
    # Requests preempted this step: the runner drops their blocks but keeps
    # their tokens and RNG state for the resume.
    preempted_req_ids: set[str] = msgspec.field(default_factory=set)
    # The KV connector's instructions for this step (loads, saves, spills);
    # None without a connector.
    kv_connector_metadata: KVConnectorMetadata | None = None
    # Async scheduling: the next schedule() needs this step's sampled tokens
    # (a grammar advances on them), so this step's outputs are processed first.
    sync_required: bool = False
    # LoRA adapter slots whose adapter changes from this step on (core/lora.py),
    # applied before the forward; every adapter a request of this step uses
    # is in a slot, loaded by this step's loads or an earlier step's.
    lora_loads: list[LoRASlotLoad] = msgspec.field(default_factory=list)
    # What the step computes, for the step cost model (core/step_cost.py);
    # None when steps are not latency-bounded.
    step_shape: StepShape | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


class LogprobEntry(NamedTuple):
    """Logprobs at one position: index 0 is the chosen token, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # 1-based rank of the chosen token


class SpecStepTimes(msgspec.Struct, array_like=True):
    """One step's speculative-decoding timings and the policy's choice, as
    the model runner measured them (ModelRunnerOutput.spec_step)."""

    verify_s: float  # the target's forward + sampling / verification
    draft_s: float  # the drafter's propose (0.0: not asked)
    num_sampled_reqs: int  # requests that sampled (the policy chose for these)
    num_drafted_reqs: int  # of them, those the policy let draft (> 0 tokens)


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    # req_id -> tokens sampled this step (empty for a partial prefill chunk).
    sampled_token_ids: dict[str, list[int]]
    # req_id -> one entry per sampled token, for requests that asked.
    logprobs: dict[str, list[LogprobEntry]] = msgspec.field(default_factory=dict)
    # req_id -> entries for the prompt positions computed this step
    # (None for the very first prompt token, which has no logprob).
    prompt_logprobs: dict[str, list[LogprobEntry | None]] = msgspec.field(default_factory=dict)
    # req_id -> draft tokens the drafter proposed for the next step.
    spec_token_ids: dict[str, list[int]] = msgspec.field(default_factory=dict)
    # req_id -> drafts verified in place of the step's DRAFT_PLACEHOLDERs
    # (async scheduling; fewer than scheduled when the policy or the drafter
    # gave fewer): what the acceptance counts count.
    num_placeholder_drafts: dict[str, int] = msgspec.field(default_factory=dict)
    # The KV connector's worker side's report (None without a connector).
    kv_connector_output: KVConnectorOutput | None = None
    # Custom figures the ranks' components (connector worker sides, the
    # drafter) collected this step, summed over the ranks (core/custom_stats.py).
    custom_stats: dict[str, FigureValue] | None = None
    # With a drafter: this step's verify and draft times and the policy's choice.
    spec_step: SpecStepTimes | None = None
    # Rank 0's wall seconds for this step (inputs, forward, sampling, drafting):
    # what the step cost model is fitted on.
    execute_time_s: float = 0.0
