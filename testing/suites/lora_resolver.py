"""The LoRA-resolver suite: built as ``Cls(lora_config)``, a resolver answers
a folder (str or Path) or None, says None for names it does not know, and
never answers a folder outside what it serves for hostile names (path
traversal in a client's `model`)."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

from pagedllm.testing.components import load
from pagedllm.testing.suite import ConformanceError, Suite

KIND = "lora_resolver"
SUITE = Suite(KIND)

BASE_MODEL = "base-model"
# Names a client may send as `model` to escape a resolver's folder.
HOSTILE_NAMES = ("..", "../etc", "/etc", "a/../../b", "..\\..\\b", ".")


def _resolver(rule: str, name: str) -> Any:
    from pagedllm.core.config import LoRAConfig

    cls = load(rule, KIND, name)
    try:
        return cls(LoRAConfig(enable_lora=True))
    except Exception as exc:
        raise ConformanceError(rule, f"{name}(lora_config) failed: {type(exc).__name__}: {exc}") from exc


def _answer(resolver: Any, lora_name: str) -> Any:
    found = resolver.resolve_lora(BASE_MODEL, lora_name)
    if asyncio.iscoroutine(found):
        found = asyncio.run(found)
    return found


@SUITE.rule("unknown-name-is-none")
def check_unknown_name(name: str) -> None:
    """A name no one uses resolves to None (the next resolver is asked, then a 404)."""
    rule = "unknown-name-is-none"
    unknown = f"pagedllm-conformance-no-such-adapter-{uuid.uuid4().hex}"
    answer = _answer(_resolver(rule, name), unknown)
    if answer is not None:
        raise ConformanceError(rule, f"resolve_lora({BASE_MODEL!r}, {unknown!r}) returned {answer!r}, not None")


@SUITE.rule("hostile-names-are-none")
def check_hostile_names(name: str) -> None:
    """Path-like names (`..`, absolute paths, separators) resolve to None or
    to a folder holding adapter_config.json, never to a parent or system folder."""
    rule = "hostile-names-are-none"
    resolver = _resolver(rule, name)
    for hostile in HOSTILE_NAMES:
        answer = _answer(resolver, hostile)
        if answer is None:
            continue
        if not isinstance(answer, (str, Path)) or not (Path(answer) / "adapter_config.json").is_file():
            raise ConformanceError(rule, f"resolve_lora({BASE_MODEL!r}, {hostile!r}) returned {answer!r}")
