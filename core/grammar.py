"""What the core asks of structured output: the grammar manager that the
scheduler and the engine loop call. `structured_output.manager` implements it
(grammars compile on a thread pool); the core never imports it.

A request's own grammar state is `core.request.StructuredOutputRequest`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from pagedllm.core.request import Request


class GrammarManager(Protocol):
    def grammar_init(self, request: Request) -> None:
        """Start compiling the request's grammar (or take it from the cache)
        and set `request.structured_output_request`."""
        ...

    def grammar_bitmask(
        self,
        requests: dict[str, Request],
        structured_output_request_ids: list[str],
        scheduled_spec_decode_tokens: dict[str, list[int]],
    ) -> torch.Tensor | None:
        """The token bitmask rows of this step's sampled positions, in batch
        order (1 + len(drafts) rows per listed request)."""
        ...

    def is_reasoning_ended(self, request: Request) -> bool:
        """False while the request is still in its reasoning section (a
        reasoning parser is configured and has not seen it end): its grammar
        waits, and its sampled positions get no bitmask rows."""
        ...

    def grammar_token_ids(self, request: Request, new_token_ids: Sequence[int]) -> Sequence[int]:
        """Of the tokens just appended to the request, those its grammar
        advances on (the ones after the end of reasoning)."""
        ...

    def wait_for_compiles(self, timeout_s: float) -> None:
        """Block until any compile finishes or `timeout_s` passes."""
        ...
