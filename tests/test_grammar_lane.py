"""The validator lane (structured_output.validator): cheap specs are answered
while costly ones hold it, a client's costly specs wait in its own bounded
queue (past it: CompileQueueFullError) that a waiter who gives up leaves,
and a spec compiled by the API side is loaded, not compiled again, by
the engine core."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.sleepy_grammar import SleepyBackend
from helpers.tiny_models import cached_tiny_model

from pagedllm.core.config import StructuredOutputConfig
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams as SO
from pagedllm.engine.llm import LLM
from pagedllm.structured_output.compile_cost import presumed_costly
from pagedllm.structured_output.interface import StructuredOutputKind
from pagedllm.structured_output.validator import (
    CompileQueueFullError,
    GrammarCheck,
    GrammarOutcome,
    GrammarValidator,
    get_validator,
)
from pagedllm.structured_output.whitespace import WhitespaceOptions

TESTS_DIR = Path(__file__).parent
# Longer than any test waits: a spec of it is still running when the test ends.
FOREVER = 600
# "{600}": a repetition bound the lane presumes costly.
COSTLY = "{600}"


@pytest.fixture(autouse=True)
def _children_import_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", f"{TESTS_DIR}{os.pathsep}{path}" if path else str(TESTS_DIR))


def _check(spec: str, config: StructuredOutputConfig) -> GrammarCheck:
    return GrammarCheck.of(SleepyBackend, StructuredOutputKind.REGEX, spec, WhitespaceOptions(True, 4), config)


def _lane(num_children: int) -> Iterator[GrammarValidator]:
    lane = GrammarValidator(num_children)
    try:
        yield lane
    finally:
        lane.close()


@pytest.fixture
def lane2() -> Iterator[GrammarValidator]:
    yield from _lane(2)


@pytest.fixture
def lane3() -> Iterator[GrammarValidator]:
    yield from _lane(3)


def _warm(lane: GrammarValidator, config: StructuredOutputConfig, num_children: int) -> None:
    """Every child started and idle (no cold start races what a test measures)."""
    futures = [lane.submit(_check(f"sleep 0.3 warm{index}", config)) for index in range(num_children)]
    assert [future.result(120).refusal for future in futures] == [None] * num_children
    deadline = time.monotonic() + 120  # a hang guard only
    while (len(lane.pids) < num_children or len(lane._idle) < num_children) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(lane.pids) == num_children


def test_presumed_costly_specs() -> None:
    assert presumed_costly('{"type": "string", "pattern": ".{0,6000}"}')
    assert presumed_costly("[a-z]{2,500}") and presumed_costly("x{1234567890123}")
    assert not presumed_costly('{"type": "string", "maxLength": 6000, "pattern": "[a-z]{1,20}"}')
    assert not presumed_costly('{"properties": {"a": {"type": "integer"}}}')
    assert presumed_costly("a" * 16 * 1024) and not presumed_costly("a" * 1000)


def test_a_cheap_spec_is_answered_while_costly_specs_hold_the_lane(lane2: GrammarValidator) -> None:
    config = StructuredOutputConfig(compile_timeout_s=FOREVER, cheap_compile_s=1.0)
    _warm(lane2, config, 2)
    # One client: two presumed costly (one runs, one waits in the client's
    # queue) and one that only its clock shows to be costly: it runs on the
    # other child until cheap_compile_s, then is taken back (the costly lane
    # is full) and queued as costly.
    slow = [lane2.submit(_check(f"sleep {FOREVER} {COSTLY} {index}", config)) for index in range(2)]
    unknown = lane2.submit(_check(f"sleep {FOREVER} unknown", config))
    time.sleep(0.1)  # the unknown spec is on the second child
    cheap = lane2.submit(_check("sleep 0 cheap", config))
    assert cheap.result(120) == GrammarOutcome(None, None)
    assert not any(future.done() for future in [*slow, unknown])
    assert lane2.num_compiles == 3  # the two warm-ups and the cheap spec
    # Known costly by its key from now on: straight to the costly queue.
    assert lane2._jobs[_check(f"sleep {FOREVER} unknown", config).key].costly


def test_a_client_past_its_costly_queue_is_refused_and_others_take_turns(lane3: GrammarValidator) -> None:
    config = StructuredOutputConfig(compile_timeout_s=FOREVER, max_costly_compiles_per_client=1,
                                    max_queued_compiles_per_client=1)
    _warm(lane3, config, 3)
    running = lane3.submit(_check(f"sleep {FOREVER} {COSTLY} a1", config), client="10.0.0.1")
    waiting = lane3.submit(_check(f"sleep {FOREVER} {COSTLY} a2", config), client="10.0.0.1")
    with pytest.raises(CompileQueueFullError) as info:
        lane3.submit(_check(f"sleep 0 {COSTLY} a3", config), client="10.0.0.1")
    assert str(info.value) == (
        "structured_outputs.regex: this client (10.0.0.1) already has 1 costly grammar compiles waiting; "
        "the limit is structured_output.max_queued_compiles_per_client = 1; retry later"
    )
    # Another client's costly spec runs on the costly slot the first client
    # may not take (one of its costly specs at a time), and a cheap spec of
    # the first client is not held up by its own costly ones.
    other = lane3.submit(_check(f"sleep 0 {COSTLY} b1", config), client="10.0.0.2")
    cheap = lane3.submit(_check("sleep 0 a4", config), client="10.0.0.1")
    assert other.result(120).refusal is None and cheap.result(120).refusal is None
    assert not running.done() and not waiting.done()
    # A waiter that gives up leaves the queue: the client's place is free again.
    assert waiting.cancel()
    assert _check(f"sleep {FOREVER} {COSTLY} a2", config).key not in lane3._jobs
    lane3.submit(_check(f"sleep 0 {COSTLY} a5", config), client="10.0.0.1")


def test_a_spec_compiled_by_the_api_side_is_loaded_not_compiled_by_the_core() -> None:
    model_dir = cached_tiny_model("llama", with_tokenizer=True, seed=5)
    llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256)
    manager = llm.engine_core.engine_core.scheduler.structured_output_manager
    validator = get_validator()
    # 26 KB compiled, 31 KB serialized (measured): small enough to share.
    schema = {"type": "string", "pattern": "[a-z ]{0,400}"}
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=SO(json=schema))
    compiles_before = validator.num_compiles
    first = llm.generate(["a"], params, use_tqdm=False)[0].outputs[0]
    second = llm.generate(["b"], params, use_tqdm=False)[0].outputs[0]
    assert validator.num_compiles == compiles_before + 1  # the API side: once
    assert (manager.stats.misses, manager.stats.loaded, manager.stats.hits) == (1, 1, 1)
    assert manager.stats.compile_seconds == []  # the core: never
    for output in (first, second):
        assert output.finish_reason == "length" and re.fullmatch(r'"[a-z ]*', output.text), output.text
