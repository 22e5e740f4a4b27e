"""Bounded grammars: specs past a size or nesting limit are refused before any
parser runs; validation runs in a child process that is killed and replaced
past structured_output.compile_timeout_s; the engine core fails a compile
that runs past the same limit without stalling the grammars behind it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_models import cached_tiny_model

from pagedllm.core.config import StructuredOutputConfig
from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams as SO
from pagedllm.engine.llm import LLM
from pagedllm.plugins import get_plugin_manager, hookimpl
from pagedllm.structured_output.interface import StructuredOutputKind
from pagedllm.structured_output.limits import check_spec_limits, json_text_depth
from pagedllm.structured_output.manager import StructuredOutputManager, validate_structured_outputs
from pagedllm.structured_output.validator import GrammarCheck, GrammarValidator, GrammarVocab, get_validator
from pagedllm.structured_output.whitespace import WhitespaceOptions
from pagedllm.structured_output.xgrammar_backend import XgrammarBackend

DEFAULTS = StructuredOutputConfig()
# 68 KB: xgrammar parses it in ~0.1 s but compiles it against the 8k tiny
# vocabulary in ~26 s (measured): only the compile shows its cost.
SLOW_REGEX = "(a|b|c|d|e|f|g|h)" * 4000


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=5)


@pytest.fixture(scope="module")
def vocab(model_dir: Path) -> GrammarVocab:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return GrammarVocab(str(model_dir), len(tokenizer), tokenizer.eos_token_id)


def _deep_items(depth: int) -> dict[str, Any]:
    """{"items": {"items": ... {} }}: `depth` levels of JSON nesting (built without recursion)."""
    schema: dict[str, Any] = {}
    for _ in range(depth - 1):
        schema = {"items": schema}
    return schema


def _deep_items_text(depth: int) -> str:
    return '{"items": ' * (depth - 1) + "{}" + "}" * (depth - 1)


def _refusal(params: SO, config: StructuredOutputConfig = DEFAULTS, **kwargs: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        validate_structured_outputs(params, config, **kwargs)
    return info.value


# ------------------------------------------------------------ size and depth


@pytest.mark.parametrize("depth", [400, 10_000])
@pytest.mark.parametrize("form", ["dict", "text"])
@pytest.mark.parametrize("kind", ["json", "structural_tag"])
def test_deep_spec_is_refused_naming_the_depth_limit_without_recursing(depth: int, form: str, kind: str) -> None:
    spec = _deep_items(depth) if form == "dict" else _deep_items_text(depth)
    # NOTE: depth 10_000 is the "without recursing" check: a parse that recursed
    # per level would raise RecursionError (limit ~1000) instead of refusing.
    error = _refusal(SO(**{kind: spec}))
    assert error.field == f"structured_outputs.{kind}"
    assert error.limit == f"nesting depth {depth} exceeds structured_output.max_schema_depth = 64"
    assert len(str(error.value)) < 120  # a short form, not the spec


def test_json_text_depth_matches_the_parsed_document() -> None:
    def reference(value: Any) -> int:
        if isinstance(value, dict):
            return 1 + max(map(reference, value.values()), default=0)
        if isinstance(value, list):
            return 1 + max(map(reference, value), default=0)
        return 0

    for text in ['{"a": "[[[{{"}', '{"a\\"[": ["\\\\", {"b": [[]]}]}', "[]", "1", '"{"', "[[], [[]], {}]",
                 json.dumps(_deep_items(30)), '{"x": "\\u005b\\"]"}']:
        assert json_text_depth(text) == reference(json.loads(text)), text


def _oversized(kind: str, num_bytes: int) -> Any:
    """A valid spec of `kind` of exactly `num_bytes` bytes (UTF-8)."""
    if kind == "regex":
        return "é" + "a" * (num_bytes - 2)  # 2-byte character: bytes, not characters, count
    if kind == "grammar":
        prefix = 'root ::= "'
        return prefix + "a" * (num_bytes - len(prefix) - 1) + '"'
    if kind in ("json", "structural_tag"):
        prefix = '{"description": "'
        return prefix + "a" * (num_bytes - len(prefix) - 2) + '"}'
    return ["a" * (num_bytes - 2), "b", "c"]  # choice: the sum of the choices


@pytest.mark.parametrize("kind", ["regex", "grammar", "json", "structural_tag", "choice"])
def test_every_kind_is_refused_past_max_spec_bytes(kind: str) -> None:
    config = StructuredOutputConfig(max_spec_bytes=1000)
    check_spec_limits(SO(**{kind: _oversized(kind, 1000)}), config)  # at the limit: fine
    error = _refusal(SO(**{kind: _oversized(kind, 1001)}), config)
    assert error.field == f"structured_outputs.{kind}"
    assert error.limit == "size 1001 bytes exceeds structured_output.max_spec_bytes = 1000"
    # The default limit too (128 KiB), on a spec a little past it.
    error = _refusal(SO(**{kind: _oversized(kind, 128 * 1024 + 1)}))
    assert error.limit == "size 131073 bytes exceeds structured_output.max_spec_bytes = 131072"


def test_a_json_dict_is_measured_as_its_json_text() -> None:
    schema = {"enum": ["x" * 2000]}
    size = len(json.dumps(schema).encode())
    check_spec_limits(SO(json=schema), StructuredOutputConfig(max_spec_bytes=size))
    error = _refusal(SO(json=schema), StructuredOutputConfig(max_spec_bytes=size - 1))
    assert error.limit == f"size {size} bytes exceeds structured_output.max_spec_bytes = {size - 1}"


def test_small_configured_limits_trigger_on_small_specs() -> None:
    config = StructuredOutputConfig(max_schema_depth=3, max_choices=2)
    check_spec_limits(SO(json=_deep_items(3)), config)
    assert _refusal(SO(json=_deep_items(4)), config).limit == (
        "nesting depth 4 exceeds structured_output.max_schema_depth = 3"
    )
    check_spec_limits(SO(choice=["a", "b"]), config)
    error = _refusal(SO(choice=["a", "b", "c"]), config)
    assert (error.field, error.limit) == ("structured_outputs.choice",
                                          "3 choices exceed structured_output.max_choices = 2")


def test_a_lone_surrogate_in_a_spec_is_refused_by_name() -> None:
    error = _refusal(SO(regex="ab\ud800c"))
    assert error.field == "structured_outputs.regex"
    assert "unpaired UTF-16 surrogate at character 2" in error.limit


# ------------------------------------------------------ the validator child


def test_slow_compile_is_killed_at_the_time_limit_and_the_child_replaced(vocab: GrammarVocab) -> None:
    config = StructuredOutputConfig(compile_timeout_s=1.0)
    validate_structured_outputs(SO(regex="[0-9]{3}"), config, vocab)  # the child starts and loads the vocab
    old_pids = set(get_validator().pids)
    start = time.monotonic()
    error = _refusal(SO(regex=SLOW_REGEX), config, vocab=vocab)
    elapsed = time.monotonic() - start
    (old_pid,) = old_pids - set(get_validator().pids)
    assert error.field == "structured_outputs.regex"
    assert error.limit == (
        "validating and compiling it took longer than structured_output.compile_timeout_s = 1 s"
    )
    assert elapsed >= 1.0
    # The old child is gone (killed and reaped), a new one serves the next call.
    with pytest.raises(ProcessLookupError):
        os.kill(old_pid, 0)
    validate_structured_outputs(SO(regex="[a-z]{2}"), config, vocab)
    assert old_pid not in get_validator().pids
    assert "parenthesis" in _refusal(SO(regex="(open"), config, vocab=vocab).limit
    # A refused spec is remembered: the same request is not compiled again, so
    # no child runs into the limit and is replaced.
    pids = get_validator().pids
    assert _refusal(SO(regex=SLOW_REGEX), config, vocab=vocab).limit == error.limit
    assert get_validator().pids == pids


def test_without_a_vocab_the_parse_is_time_limited() -> None:
    # xgrammar's schema conversion grows ~ depth^3: 250 object levels (JSON
    # depth 501) take ~1.5 s to parse (measured), with no vocab involved.
    config = StructuredOutputConfig(compile_timeout_s=0.2, max_schema_depth=512)
    schema: dict[str, Any] = {"type": "integer"}
    for _ in range(250):
        schema = {"type": "object", "properties": {"a": schema}}
    error = _refusal(SO(json=schema), config)
    assert error.limit == "validating and compiling it took longer than structured_output.compile_timeout_s = 0.2 s"


def test_concurrent_validations_share_one_child(vocab: GrammarVocab) -> None:
    errors: list[BaseException] = []

    def validate(index: int) -> None:
        try:
            validate_structured_outputs(SO(regex=f"x{index}[0-9]{{{index + 1}}}"), DEFAULTS, vocab)
            with pytest.raises(InvalidRequestError, match="parenthesis"):
                validate_structured_outputs(SO(regex=f"({index}"), DEFAULTS, vocab)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=validate, args=(index,)) for index in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert errors == []


_ORPHAN_SCRIPT = """
import sys, time
from pagedllm.core.config import StructuredOutputConfig
from pagedllm.core.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.manager import validate_structured_outputs
from pagedllm.structured_output.validator import get_validator
validate_structured_outputs(StructuredOutputsParams(regex="a+"), StructuredOutputConfig())
print(get_validator().pid, flush=True)
time.sleep(120)
"""


def test_the_child_dies_with_its_parent_and_on_close() -> None:
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(parent.stdout.readline())
        os.kill(child_pid, 0)
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
    deadline = time.monotonic() + 60  # a hang guard only
    while _alive(child_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child_pid)
    validator = GrammarValidator()
    validator.validate(GrammarCheck.of(XgrammarBackend, StructuredOutputKind.REGEX, "b+", WhitespaceOptions(True, 4),
                                       DEFAULTS))
    pid = validator.pid
    validator.close()
    assert pid is not None and not _alive(pid)


def test_a_costly_spec_holds_up_only_its_own_child(vocab: GrammarVocab) -> None:
    """One client's spec compiling to the time limit does not delay another's:
    a second child serves while the first is busy."""
    config = StructuredOutputConfig(compile_timeout_s=12.0)
    validator = GrammarValidator(max_children=2)
    whitespace = WhitespaceOptions(True, 4)

    def check(regex: str) -> GrammarCheck:
        return GrammarCheck.of(XgrammarBackend, StructuredOutputKind.REGEX, regex, whitespace, config, vocab)

    try:
        # NOTE: both children warm first, so no cold start (imports, vocab: 3 s idle,
        # 30 s on a loaded machine) races the slow spec's time limit.
        warm = [validator.submit(check(regex)) for regex in ("[0-9]{2}", "[0-9]{4}")]
        assert [future.result().refusal for future in warm] == [None, None]
        # 119 KB: compiles for about 97 s, far past the limit on any machine.
        slow = validator.submit(check("(a|b|c|d|e|f|g|h)" * 7000))
        time.sleep(0.5)  # the slow spec is in the first child by now
        started = time.monotonic()
        validator.validate(check("[a-z]{3}"))
        fast_elapsed = time.monotonic() - started
        assert not slow.done(), f"the fast spec waited for the slow one ({fast_elapsed:.1f} s)"
        refusal = slow.result().refusal
        assert refusal is not None and "compile_timeout_s = 12 s" in refusal.limit
        assert len(validator.pids) == 2
    finally:
        validator.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(")")[-1].split()[0] != "Z"


# ------------------------------------------------------------ engine core


def test_the_manager_refuses_an_over_limit_spec_without_compiling(model_dir: Path) -> None:
    config = StructuredOutputConfig(max_schema_depth=8)
    manager = StructuredOutputManager(config, vocab_size=8192, tokenizer=str(model_dir), eos_token_id=2,
                                      max_num_rows=4)
    request = Request("deep", [1, 2], SamplingParams(structured_outputs=SO(json=_deep_items(9))), eos_token_id=2)
    manager.grammar_init(request)
    so_request = request.structured_output_request
    assert so_request is not None and so_request.is_ready() and so_request.grammar is None
    assert so_request.error == (
        "structured output (xgrammar, json) refused: structured_outputs.json='<dict nested too deep to show>' "
        "is invalid: nesting depth 9 exceeds structured_output.max_schema_depth = 8"
    )
    assert (manager.stats.misses, manager._pool, manager._backends) == (0, None, {})
    manager.close()


class _StuckBackend(XgrammarBackend):
    """xgrammar, but a regex starting with "stuck" compiles only once released."""

    release = threading.Event()
    name = "stuck"

    def compile(self, kind: StructuredOutputKind, spec: str, *, any_whitespace: bool = True,
                max_whitespace: int | None = None) -> Any:
        if spec.startswith("stuck"):
            assert self.release.wait(60)
        return super().compile(kind, spec, any_whitespace=any_whitespace, max_whitespace=max_whitespace)


class _StuckPlugin:
    @hookimpl
    def register_grammar_backends(self, register: Any) -> None:
        register("stuck", _StuckBackend)


def test_a_core_compile_past_the_limit_fails_only_its_request(model_dir: Path) -> None:
    plugin = _StuckPlugin()
    get_plugin_manager().register(plugin, name="test-stuck-grammar")
    _StuckBackend.release.clear()
    try:
        # One compile thread: the request queued behind the stuck compile
        # must still get its grammar (the pool is replaced).
        llm = LLM(str(model_dir), num_kv_blocks=64, max_model_len=256,
                  structured_outputs_config={"compile_timeout_s": 0.5, "num_compile_threads": 1})
        core, eos = llm.engine_core.engine_core, llm.eos_token_id

        def params(regex: str | None, max_tokens: int = 8) -> SamplingParams:
            so = SO(regex=regex, backend="stuck") if regex else None
            return SamplingParams(temperature=0.0, max_tokens=max_tokens, structured_outputs=so)

        # Straight to the core, as a request that skipped the API-side check.
        core.add_request(Request("stuck", [5, 6, 7], params("stuck[0-9]"), eos_token_id=eos))
        core.add_request(Request("queued", [5, 6, 7], params("[0-9]{3}"), eos_token_id=eos))
        core.add_request(Request("plain", [5, 6, 7], params(None, max_tokens=5), eos_token_id=eos))
        start, finished, tokens = time.monotonic(), {}, {}
        while core.has_unfinished_requests() and time.monotonic() - start < 60:  # a hang guard only
            for output in core.step().outputs:
                tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
                if output.finished:
                    finished[output.request_id] = output
        assert finished["stuck"].finish_reason == "abort" and tokens.get("stuck", []) == []
        assert finished["stuck"].stop_reason == (
            "structured output (stuck, regex) failed to compile: "
            "the compile took longer than structured_output.compile_timeout_s = 0.5 s"
        )
        assert finished["queued"].finish_reason == "stop", finished["queued"].stop_reason
        assert llm.tokenizer.decode(tokens["queued"][:-1]).isdigit()
        assert finished["plain"].finish_reason == "length" and len(tokens["plain"]) == 5
    finally:
        _StuckBackend.release.set()
        get_plugin_manager().unregister(plugin)
