"""The KV connector suite: blocks go out and come back unchanged, what is
not there is not claimed, and finished requests' blocks are returned.

Every rule runs the connector in an engine on the shipped tiny model
(``uni`` executor, role ``both`` when the connector declares it, float32)
and takes the expected tokens from the same engine without a connector.
The delayed-free contract runs first: a connector that holds blocks for
ever keeps every engine busy, and the rule that says so must be the one
that fails. The connector gets ``kv_transfer.extra`` with the keys pagedllm's own and the
example connectors read: ``path`` (a fresh temporary directory) and
``namespace`` (a fresh name); a connector needing more is configured through
``CONNECTOR_EXTRA[name]``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

from pagedllm.testing.components import load, registration
from pagedllm.testing.engine_runs import (
    BLOCK_SIZE,
    block_leak,
    engine_core,
    generate_tokens,
    limit_steps,
    random_prompts,
    tiny_llm,
)
from pagedllm.testing.suite import ConformanceError, RuleSkipped, Suite

KIND = "kv_connector"
SUITE = Suite(KIND)

# Extra kv_transfer.extra settings by connector name (merged over the defaults).
CONNECTOR_EXTRA: dict[str, dict[str, Any]] = {}
# Small pool: the second batch of prompts evicts the first from the local prefix cache.
NUM_KV_BLOCKS = 24
PROMPT_LEN = 4 * BLOCK_SIZE + 5  # four full blocks and a partial one
MAX_STEPS = 400


def _params() -> Any:
    from pagedllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _role(rule: str, name: str) -> str:
    roles = registration(rule, KIND, name).info.roles
    return "both" if not roles or "both" in roles else roles[0]


@contextlib.contextmanager
def _connector_config(rule: str, name: str) -> Iterator[dict[str, Any]]:
    with tempfile.TemporaryDirectory(prefix="pagedllm-conformance-") as path:
        extra = {"path": path, "namespace": f"conformance-{uuid.uuid4().hex}", **CONNECTOR_EXTRA.get(name, {})}
        yield {"connector": name, "role": _role(rule, name), "extra": extra, "load_failure_policy": "recompute"}


@contextlib.contextmanager
def _debug_kv() -> Iterator[None]:
    """The KV manager's invariant check after every step (PAGEDLLM_DEBUG_KV)."""
    before = os.environ.get("PAGEDLLM_DEBUG_KV")
    os.environ["PAGEDLLM_DEBUG_KV"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["PAGEDLLM_DEBUG_KV"]
        else:
            os.environ["PAGEDLLM_DEBUG_KV"] = before


def _engine(rule: str, kv_config: dict[str, Any]) -> Any:
    try:
        return tiny_llm(num_kv_blocks=NUM_KV_BLOCKS, kv_transfer_config=kv_config)
    except Exception as exc:
        raise ConformanceError(rule, f"no engine started with the connector: {type(exc).__name__}: {exc}") from exc


def _generate(rule: str, llm: Any, prompts: list[list[int]], expected: list[list[int]], what: str) -> None:
    try:
        tokens = generate_tokens(llm, prompts, _params())
    except ConformanceError:
        raise
    except Exception as exc:
        raise ConformanceError(rule, f"{what}: generation raised {type(exc).__name__}: {exc}") from exc
    if tokens != expected:
        raise ConformanceError(rule, f"{what}: tokens {tokens} differ from an engine without the connector {expected}")


def _reference(prompts: list[list[int]]) -> list[list[int]]:
    return generate_tokens(tiny_llm(num_kv_blocks=NUM_KV_BLOCKS), prompts, _params())


@SUITE.rule("loads")
def check_loads(name: str) -> None:
    """The target imports and subclasses KVConnectorBase; an engine starts with it."""
    load("loads", KIND, name)
    with _connector_config("loads", name) as kv_config:
        _engine("loads", kv_config)


@SUITE.rule("delayed-free-contract")
def check_delayed_free(name: str) -> None:
    """Every request whose `request_finished` returned True is named once by
    `get_finished` (as a finished save) within the run; none is named that
    was not held; afterwards every KV block is free again."""
    rule = "delayed-free-contract"
    prompts = random_prompts(3, PROMPT_LEN, seed=4)
    with _debug_kv(), _connector_config(rule, name) as kv_config:
        llm = _engine(rule, kv_config)
        limit_steps(rule, llm, MAX_STEPS)
        held, reported = _trace_delayed_free(rule, engine_core(llm).scheduler)
        _generate(rule, llm, prompts, _reference(prompts), "generation")
        leak = block_leak(llm)
    if held - reported:
        raise ConformanceError(
            rule, f"request_finished kept the blocks of {sorted(held - reported)}, never reported by get_finished"
        )
    if leak is not None:
        raise ConformanceError(rule, f"after every request finished: {leak}")


@SUITE.rule("missing-blocks-not-claimed")
def check_missing(name: str) -> None:
    """Prompts never seen claim no external tokens, count no load failure, and
    generate exactly the tokens of an engine without the connector."""
    rule = "missing-blocks-not-claimed"
    prompts = random_prompts(2, PROMPT_LEN, seed=3)
    expected = _reference(prompts)
    with _debug_kv(), _connector_config(rule, name) as kv_config:
        llm = _engine(rule, kv_config)
        limit_steps(rule, llm, MAX_STEPS)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], _params(), use_tqdm=False)
        tokens = [list(o.outputs[0].token_ids) for o in outputs]
        stats = _stats(llm)
    if tokens != expected:
        raise ConformanceError(rule, f"tokens {tokens} differ from an engine without the connector {expected}")
    if stats.external_hits or any(o.num_cached_tokens for o in outputs):
        raise ConformanceError(
            rule, f"nothing was stored, yet {stats.external_hits} tokens were claimed as external hits"
        )
    if stats.load_failures:
        raise ConformanceError(rule, f"nothing was stored, yet {stats.load_failures} load failures were counted")


@SUITE.rule("save-load-round-trip")
def check_round_trip(name: str) -> None:
    """Prompts evicted from the local prefix cache come back through the
    connector (external hits counted) and generate exactly the same tokens."""
    rule = "save-load-round-trip"
    first, second = random_prompts(3, PROMPT_LEN, seed=1), random_prompts(3, PROMPT_LEN, seed=2)
    expected_first, expected_second = _reference(first), _reference(second)
    with _debug_kv(), _connector_config(rule, name) as kv_config:
        llm = _engine(rule, kv_config)
        limit_steps(rule, llm, MAX_STEPS)
        _generate(rule, llm, first, expected_first, "the first prompts")
        _generate(rule, llm, second, expected_second, "other prompts (evicting the first from the pool)")
        hits_before = _stats(llm).external_hits
        _generate(rule, llm, first, expected_first, "the first prompts again")
        loaded = _stats(llm).external_hits - hits_before
    if loaded <= 0:
        raise ConformanceError(
            rule, "the first prompts' blocks were saved and evicted locally, but none was loaded back (external_hits)"
        )


@SUITE.rule("adapter-blocks-kept-apart")
def check_adapter_identity(name: str) -> None:
    """Blocks stored for the base model are never offered to a request of a
    LoRA adapter with the same tokens (nor, so, blocks of one adapter digest
    to another): a connector names blocks by the request's block hashes,
    which carry the adapter's content digest (core/kv_cache/hashing.py),
    never by tokens alone. Probed on the scheduler side
    (`get_num_new_matched_tokens`) for two adapter digests after the base
    model's blocks were saved and evicted locally."""
    rule = "adapter-blocks-kept-apart"
    first, second = random_prompts(3, PROMPT_LEN, seed=6), random_prompts(3, PROMPT_LEN, seed=7)
    with _debug_kv(), _connector_config(rule, name) as kv_config:
        llm = _engine(rule, kv_config)
        limit_steps(rule, llm, MAX_STEPS)
        _generate(rule, llm, first, _reference(first), "the base model's prompts")
        _generate(rule, llm, second, _reference(second), "other prompts (evicting the first from the pool)")
        scheduler = engine_core(llm).scheduler
        offered = {
            label: _matched_tokens(scheduler, f"conformance-{label}", first[0], digest)
            for label, digest in (("base", None), ("adapter-a", "a" * 64), ("adapter-b", "b" * 64))
        }
    if not offered["base"]:
        raise RuleSkipped(rule, f"{name} offered none of the base model's saved blocks back ({offered['base']!r})")
    for label in ("adapter-a", "adapter-b"):
        if offered[label]:
            raise ConformanceError(
                rule, f"a request of {label} was offered {offered[label]} tokens of blocks stored for the base model"
            )


def _matched_tokens(scheduler: Any, request_id: str, tokens: list[int], lora_digest: str | None) -> int | None:
    """What the connector's scheduler side offers a fresh request of `tokens`
    (of the adapter with `lora_digest`; None: the base model)."""
    from pagedllm.core.lora import LoRARef
    from pagedllm.core.request import Request
    from pagedllm.core.sampling_params import SamplingParams

    lora = None if lora_digest is None else LoRARef(request_id, lora_digest, "/conformance/adapter")
    request = Request(request_id, list(tokens), SamplingParams(max_tokens=1), None, lora=lora)
    scheduler.kv_cache_manager.ensure_block_hashes(request)
    found: int | None = scheduler.kv_connector.get_num_new_matched_tokens(request, 0)
    return found


@SUITE.rule("corrupted-blocks-reported")
def check_corrupted(name: str) -> None:
    """Blocks stored under ``extra.path`` with a flipped byte are not loaded
    as they are: a fresh engine generates exactly the tokens of one without
    the connector and counts load failures (a connector that stores nothing
    under ``extra.path`` cannot be damaged from outside: skipped)."""
    from pathlib import Path

    rule = "corrupted-blocks-reported"
    prompts = random_prompts(2, PROMPT_LEN, seed=5)
    expected = _reference(prompts)
    with _debug_kv(), _connector_config(rule, name) as kv_config:
        writer = _engine(rule, kv_config)
        _generate(rule, writer, prompts, expected, "storing the blocks")
        stored = [f for f in sorted(Path(kv_config["extra"]["path"]).rglob("*")) if f.is_file()]
        if not stored:
            raise RuleSkipped(rule, f"{name} stores nothing under kv_transfer.extra.path")
        for file in stored:
            data = bytearray(file.read_bytes())
            if len(data) > 64:  # NOTE: inside the payload, past any header
                data[-10] ^= 0xFF
                file.write_bytes(bytes(data))
        reader = _engine(rule, kv_config)
        limit_steps(rule, reader, MAX_STEPS)
        _generate(rule, reader, prompts, expected, "loading the damaged blocks")
        failures = _stats(reader).load_failures
    if failures == 0:
        raise ConformanceError(rule, f"{len(stored)} stored files were damaged, yet no load failure was counted")


def _stats(llm: Any) -> Any:
    """The connector's counts: its scheduler side's and its worker side's."""
    return engine_core(llm).scheduler.kv_connector_stats


def _trace_delayed_free(rule: str, scheduler: Any) -> tuple[set[str], set[str]]:
    """Wrap the scheduler side's request_finished and what the scheduler
    receives of the worker side's get_finished: the requests it held, and
    those reported (each once, and only held ones)."""
    held: set[str] = set()
    reported: set[str] = set()
    connector, tracker = scheduler.kv_connector, scheduler.kv_transfer
    request_finished, update_from_output = connector.request_finished, tracker.update_from_output

    def traced_request_finished(request: Any, block_ids: list[int]) -> bool:
        keep = bool(request_finished(request, block_ids))
        if keep:
            held.add(request.request_id)
        return keep

    def traced_update_from_output(kv_output: Any) -> None:
        sending = set() if kv_output is None else set(kv_output.finished_sending)
        again = sending & reported
        if again:
            raise ConformanceError(rule, f"get_finished reported the save of {sorted(again)} twice")
        unknown = sending - held
        if unknown:
            raise ConformanceError(rule, f"get_finished reported {sorted(unknown)}, whose blocks were never held")
        reported.update(sending)
        update_from_output(kv_output)

    connector.request_finished = traced_request_finished
    tracker.update_from_output = traced_update_from_output
    return held, reported
