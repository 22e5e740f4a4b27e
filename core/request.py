"""Per-request state owned by the scheduler."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pagedllm.core.lora import LoRARef
    from pagedllm.core.outputs import FinishReason
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.structured_output.interface import Grammar

# A full block's chained hash (core/kv_cache/hashing.py computes it); a request
# keeps those of its tokens, the block pool maps them to cached blocks.
BlockHash = bytes


class StructuredOutputRequest(Protocol):
    """A request's grammar as the scheduler sees it: compiling, ready
    (`grammar`) or failed (`error`). The grammar manager (core/grammar.py)
    sets it; structured_output.manager implements it."""

    grammar: Grammar | None
    error: str | None

    def is_ready(self) -> bool:
        """True once the grammar compiled or failed."""
        ...


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_FSM = enum.auto()  # grammar still compiling (structured output)
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @staticmethod
    def is_finished(status: RequestStatus) -> bool:
        return status > RequestStatus.PREEMPTED

    @staticmethod
    def get_finished_reason(status: RequestStatus) -> FinishReason | None:
        return _FINISHED_REASONS.get(status)


_FINISHED_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One sequence being generated. `n > 1` fans out into sibling Requests
    before they reach the scheduler, so a Request always has one output."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        lora: LoRARef | None = None,
        group_id: str | None = None,
    ) -> None:
        self.request_id = request_id
        # The sequences of one API request (its prompts and n samples) share
        # it; fair sharing (core/fair_share.py) divides seats between groups.
        self.group_id = request_id if group_id is None else group_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora = lora  # its adapter (None: the base model), in every block hash

        # Structured output: the grammar compiles (WAITING_FOR_FSM) before the
        # request may be scheduled; the manager fills structured_output_request.
        self.status = (
            RequestStatus.WAITING_FOR_FSM if sampling_params.structured_outputs is not None else RequestStatus.WAITING
        )
        self.structured_output_request: StructuredOutputRequest | None = None
        # The API side's compiled grammar (engine.wire.EngineCoreRequest),
        # loaded instead of a compile; dropped once the manager has used it.
        self.compiled_grammar: bytes | None = None
        self.stop_reason: int | str | None = None
        self.output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(self.prompt_token_ids)
        # Tokens whose KV is in the cache (prompt and output alike).
        self.num_computed_tokens = 0
        # Async scheduling: tokens sampled by steps in flight whose outputs
        # the scheduler has not seen yet (the runner already knows them).
        self.num_output_placeholders = 0
        # Prompt tokens served from the prefix cache on first scheduling.
        self.num_cached_tokens = -1
        # Draft tokens to verify in the next step (speculative decoding).
        self.spec_token_ids: list[int] = []
        # Verification steps with drafts, drafts proposed, drafts accepted.
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        # Hashes of the full blocks of all_token_ids, filled by the KV manager.
        self.block_hashes: list[BlockHash] = []
        self.num_preemptions = 0
        # Timestamps for RequestOutput.metrics (time.time()).
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        # Free-form slot for plugins (grammar state, connector state, ...).
        self.extra: dict[str, Any] = {}

    @property
    def all_token_ids(self) -> list[int]:
        # NOTE: read-only view by convention; append through append_output_token_ids.
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self._all_token_ids) + len(self.spec_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self._all_token_ids.extend(token_ids)

    @property
    def use_structured_output(self) -> bool:
        return self.sampling_params.structured_outputs is not None

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finished_reason(self) -> FinishReason | None:
        return RequestStatus.get_finished_reason(self.status)

    def __lt__(self, other: Request) -> bool:
        # Priority policy: lower value first, ties by arrival, then id.
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, "
            f"prompt={self.num_prompt_tokens}, out={self.num_output_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
