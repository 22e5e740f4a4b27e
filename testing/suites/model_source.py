"""The model-source suite: built with no arguments, a source answers a
folder/hub id (a string) or None, says None for names it does not know, and
resolving imports no torch (the API process resolves before the engine starts)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

from pagedllm.testing.components import instantiate
from pagedllm.testing.suite import ConformanceError, Suite

KIND = "model_source"
SUITE = Suite(KIND)

NO_TORCH_SCRIPT = """
import sys
from pagedllm.plugins import get_plugin_manager
source = get_plugin_manager().registry("model_source").load(sys.argv[1])()
source.resolve(sys.argv[2])
print("torch" in sys.modules)
"""


def _source(rule: str, name: str) -> Any:
    return instantiate(rule, KIND, name)


@SUITE.rule("unknown-name-is-none")
def check_unknown_name(name: str) -> None:
    """A name no one uses resolves to None (so the next source, or the hub, is asked)."""
    rule = "unknown-name-is-none"
    unknown = f"pagedllm-conformance-no-such-model-{uuid.uuid4().hex}"
    answer = _source(rule, name).resolve(unknown)
    if answer is not None:
        raise ConformanceError(rule, f"resolve({unknown!r}) returned {answer!r}, not None")


@SUITE.rule("answers-str-or-none")
def check_answer_type(name: str) -> None:
    """resolve() answers a non-empty string or None for a few ordinary names."""
    rule = "answers-str-or-none"
    source = _source(rule, name)
    for probe in ("tiny", "org/model", "./relative/folder", ""):
        answer = source.resolve(probe)
        if answer is not None and not (isinstance(answer, str) and answer):
            raise ConformanceError(rule, f"resolve({probe!r}) returned {answer!r}")


@SUITE.rule("resolves-without-torch")
def check_no_torch(name: str) -> None:
    """Loading the source and resolving a name imports no torch (checked in a fresh interpreter)."""
    rule = "resolves-without-torch"
    result = subprocess.run(
        [sys.executable, "-c", NO_TORCH_SCRIPT, name, "tiny"], capture_output=True, text=True, timeout=120
    )
    if result.returncode != 0:
        raise ConformanceError(rule, f"loading and resolving in a fresh interpreter failed: {result.stderr[-1000:]}")
    if result.stdout.strip().splitlines()[-1:] != ["False"]:
        raise ConformanceError(rule, "loading the source and resolving a name imported torch")
