"""The logits-processor interface (vLLM V1's ``LogitsProcessor``).

A logits processor sees the whole batch of logits rows a step samples from,
``[num_rows, vocab_size]``, and keeps its own per-row state. Before every
``apply`` the model runner calls ``update_state`` with what changed since the
last step: rows added (with the request's params, prompt and output token
ids), rows removed, rows that moved to another index. A request activates a
processor by passing its arguments in ``SamplingParams.extra_args`` (the
server's ``vllm_xargs``); a row without them must be left untouched.

Rows and speculative decoding: without a drafter a request owns one row (the
position it samples). With a drafter it owns ``1 + n`` rows, one per draft
position and the bonus position, in order; row ``j``'s ``output_token_ids``
are the request's output tokens followed by its first ``j`` drafts, so a
processor computes exactly what it would compute had those drafts already
been sampled. That is what keeps greedy output with drafts equal to greedy
output without.

``output_token_ids`` is a live list: it grows as the request samples (and
for a draft position it is rewritten when the drafts change). Read it in
``apply``; do not copy it in ``update_state`` and expect it to stay current.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, TypeVar

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import EngineConfig
    from pagedllm.core.sampling_params import SamplingParams

T = TypeVar("T")


class AddedRequest(NamedTuple):
    """A row that joined the batch (vLLM's ``(index, params, prompt_tok_ids,
    output_tok_ids)`` tuple)."""

    row_index: int  # its row in this step's logits
    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # live: see the module docstring


class MovedRequest(NamedTuple):
    """A row that stayed in the batch at another index."""

    from_index: int  # its row in the last step's logits
    to_index: int  # its row in this step's logits


@dataclass(frozen=True)
class BatchUpdate:
    """What changed between the last step's rows and this step's.

    ``removed`` and ``moved[i].from_index`` are last step's indices;
    ``moved[i].to_index`` and ``added[i].row_index`` are this step's. Rows not
    named anywhere kept their index. Apply the removals and moves together
    (:meth:`remap` does), then the additions: an added row may take an index
    that a removed or moved row left.
    """

    batch_size: int  # rows in this step's logits
    removed: Sequence[int] = ()
    moved: Sequence[MovedRequest] = ()
    added: Sequence[AddedRequest] = ()

    def remap(self, per_row: Mapping[int, T]) -> dict[int, T]:
        """``per_row`` (last step's index -> state) with the removed rows
        dropped and the moved ones re-keyed: this step's index -> state,
        before the additions."""
        removed = set(self.removed)
        moves = {move.from_index: move.to_index for move in self.moved}
        return {moves.get(index, index): state for index, state in per_row.items() if index not in removed}


class LogitsProcessor(ABC):
    """A batch-level logits processor (plugin kind ``logits_processor``).

    Built once per worker as ``ProcessorCls(config, device)`` for every name in
    ``model.logits_processors`` (``--logits-processors``). Non-argmax-invariant
    processors run after the grammar bitmask, ``allowed_token_ids``,
    ``bad_words``, ``logit_bias`` and ``min_tokens`` and before the penalties, on the logits greedy rows take
    the argmax of; argmax-invariant ones (``is_argmax_invariant()`` True) run
    only for random rows, after the temperature (vLLM's order).
    """

    # The extra_args of a request that activates this processor, for the
    # conformance kit (pagedllm.testing.suites.logits_processor); None: the
    # kit runs only the rules that need no active request.
    example_args: ClassVar[Mapping[str, Any] | None] = None

    @abstractmethod
    def __init__(self, config: EngineConfig, device: torch.device) -> None: ...

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        """Refuse a request's arguments (from ``params.extra_args``) before it
        is scheduled: raise ``pagedllm.core.errors.InvalidRequestError`` naming
        the argument, its value and the rule (the server answers 400). Called
        in the front end's process for every request; the default accepts all."""
        return None

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True when ``apply`` never changes which token has the highest logit
        (it may then be skipped for greedy rows)."""

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Follow the batch: ``None`` when no row was added, removed or moved
        since the last call. Called once per step, before ``apply``."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """The processed logits, float32 ``[batch_size, vocab_size]`` (in
        place or a new tensor); rows of requests without this processor's
        arguments must come back unchanged."""


def extra_arg(params: SamplingParams, key: str) -> Any:
    """``params.extra_args[key]``, or None when the request did not pass it."""
    return None if params.extra_args is None else params.extra_args.get(key)


__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MovedRequest", "extra_arg"]
