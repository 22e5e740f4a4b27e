"""Conformance suite of the ``logits_processor`` kind.

Every rule builds the processor registered under the name twice or more and
compares what it computes after a sequence of batch updates with what a
fresh instance computes when the same rows arrive at once: a processor that
loses track of a row when rows are removed or moved, or that copies a
request's output ids instead of reading the live list, then disagrees with
itself. Rules that need an active request use the class's ``example_args``
(the ``extra_args`` of a request that activates it); without them only the
rules that need no arguments run.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedllm.core.config import EngineConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.logits_processors.interface import AddedRequest, BatchUpdate, LogitsProcessor, MovedRequest
from pagedllm.plugins import get_plugin_manager
from pagedllm.testing.suite import ConformanceError, Suite

SUITE = Suite("logits_processor")

VOCAB_SIZE = 64
# Tokens drawn from a small alphabet so that history-dependent processors
# (n-gram bans, penalties) find repeats to act on.
ALPHABET = 8


@dataclass
class _Request:
    params: SamplingParams
    prompt: list[int]
    output: list[int] = field(default_factory=list)

    def added(self, index: int) -> AddedRequest:
        return AddedRequest(index, self.params, self.prompt, self.output)


def _processor_class(name: str) -> type[LogitsProcessor]:
    return get_plugin_manager().logits_processors.load(name)


def _build(name: str) -> LogitsProcessor:
    return _processor_class(name)(EngineConfig(), torch.device("cpu"))


def _requests(args: Mapping[str, Any] | None, active: Sequence[bool], seed: int) -> list[_Request]:
    rng = random.Random(seed)
    return [
        _Request(
            SamplingParams(temperature=0.0, extra_args=dict(args) if is_active and args else None),
            [rng.randrange(ALPHABET) for _ in range(rng.randrange(2, 8))],
            [rng.randrange(ALPHABET) for _ in range(rng.randrange(0, 10))],
        )
        for is_active in active
    ]


def _logits(num_rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn((num_rows, VOCAB_SIZE), generator=generator)


def _apply(processor: LogitsProcessor, logits: torch.Tensor) -> torch.Tensor:
    return processor.apply(logits.clone()).clone()


def _fresh(name: str, rows: Sequence[_Request], logits: torch.Tensor) -> torch.Tensor:
    """What a new instance computes when `rows` all arrive in one update."""
    processor = _build(name)
    processor.update_state(BatchUpdate(len(rows), added=[request.added(i) for i, request in enumerate(rows)]))
    return _apply(processor, logits)


def _same(rule: str, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    if got.shape != want.shape or got.dtype != want.dtype:
        raise ConformanceError(rule, f"{what}: shape/dtype {tuple(got.shape)}/{got.dtype}, "
                                     f"expected {tuple(want.shape)}/{want.dtype}")
    if not torch.equal(got, want):
        rows = sorted({int(r) for r in (got != want).nonzero()[:, 0]})
        raise ConformanceError(rule, f"{what}: rows {rows} differ")


def _example_args(name: str) -> Mapping[str, Any] | None:
    return _processor_class(name).example_args


@SUITE.rule("example-args-are-valid")
def check_example_args(name: str) -> None:
    """``validate_params`` accepts the class's own ``example_args`` and a
    request without arguments."""
    cls = _processor_class(name)
    for extra_args in (None, cls.example_args):
        try:
            cls.validate_params(SamplingParams(extra_args=dict(extra_args) if extra_args else None))
        except Exception as exc:
            message = f"validate_params({extra_args!r}) raised {exc!r}"
            raise ConformanceError("example-args-are-valid", message) from exc


@SUITE.rule("untouched-without-args")
def check_untouched(name: str) -> None:
    """Rows of requests that did not pass the processor's arguments come back
    unchanged, also beside rows that did."""
    args = _example_args(name)
    active = [False, True, False, True] if args else [False, False, False]
    requests = _requests(args, active, seed=1)
    logits = _logits(len(requests), seed=2)
    processor = _build(name)
    processor.update_state(BatchUpdate(len(requests), added=[r.added(i) for i, r in enumerate(requests)]))
    got = _apply(processor, logits)
    inactive = [i for i, is_active in enumerate(active) if not is_active]
    _same("untouched-without-args", got[inactive], logits[inactive], "rows without arguments")


@SUITE.rule("rows-follow-adds-removes-moves")
def check_rows_follow_updates(name: str) -> None:
    """After rows are removed, moved (into a freed index, a swap) and
    added, with rows of requests without arguments landing where active
    ones were, the processor computes what a fresh one computes for the
    new layout."""
    rule = "rows-follow-adds-removes-moves"
    args = _example_args(name)
    a, b, c, d, e = _requests(args, [True, False, True, False, True], seed=3)
    processor = _build(name)
    first = [a, b, c, d]
    processor.update_state(BatchUpdate(4, added=[r.added(i) for i, r in enumerate(first)]))
    logits = _logits(4, seed=4)
    _same(rule, _apply(processor, logits), _fresh(name, first, logits), "the first step")
    # a (0) removed; b 1 -> 0 into the freed index; c and d swap (2 <-> 3); e added at 1.
    second = [b, e, d, c]
    processor.update_state(BatchUpdate(
        4, removed=[0], moved=[MovedRequest(1, 0), MovedRequest(2, 3), MovedRequest(3, 2)], added=[e.added(1)]
    ))
    logits = _logits(4, seed=5)
    _same(rule, _apply(processor, logits), _fresh(name, second, logits), "after a removal, moves and an addition")
    # The batch shrinks: e (1) and d (2) removed, c 3 -> 0, b 0 -> 1.
    third = [c, b]
    processor.update_state(BatchUpdate(2, removed=[1, 2], moved=[MovedRequest(3, 0), MovedRequest(0, 1)]))
    logits = _logits(2, seed=6)
    _same(rule, _apply(processor, logits), _fresh(name, third, logits), "after the batch shrank")


@SUITE.rule("reads-output-tokens-live")
def check_reads_output_live(name: str) -> None:
    """Tokens appended to a request's output list between steps (no batch
    update: ``update_state(None)``) are seen, as after sampling."""
    args = _example_args(name)
    requests = _requests(args, [True, False, True], seed=7)
    processor = _build(name)
    processor.update_state(BatchUpdate(3, added=[r.added(i) for i, r in enumerate(requests)]))
    _apply(processor, _logits(3, seed=8))
    rng = random.Random(9)
    for step in range(4):
        for request in requests:
            request.output.append(rng.randrange(ALPHABET))
        processor.update_state(None)
        logits = _logits(3, seed=10 + step)
        _same("reads-output-tokens-live", _apply(processor, logits), _fresh(name, requests, logits),
              f"after {step + 1} appended token(s)")


@SUITE.rule("deterministic")
def check_deterministic(name: str) -> None:
    """The same rows and logits give the same result, twice in one instance
    and in two instances; the shape and dtype are kept."""
    args = _example_args(name)
    requests = _requests(args, [True, True, False], seed=11)
    logits = _logits(3, seed=12)
    first = _fresh(name, requests, logits)
    _same("deterministic", first, _fresh(name, requests, logits), "two instances")
    processor = _build(name)
    processor.update_state(BatchUpdate(3, added=[r.added(i) for i, r in enumerate(requests)]))
    _apply(processor, logits)
    processor.update_state(None)
    _same("deterministic", _apply(processor, logits), first, "a second apply")
