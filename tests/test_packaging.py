"""The distribution lists every package of the source tree (a regular,
non-editable `pip install` ships only what pyproject.toml names)."""

from __future__ import annotations

import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NOT_SHIPPED = {"tests", "examples", "benchmarks", "build", "docs"}


def test_every_source_package_is_in_the_distribution() -> None:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    listed = set(pyproject["tool"]["setuptools"]["packages"])
    found = set()
    for init in REPO_ROOT.rglob("__init__.py"):
        parts = init.parent.relative_to(REPO_ROOT).parts
        if parts and (parts[0] in NOT_SHIPPED or parts[0].startswith(".")):
            continue
        found.add(".".join(("pagedllm", *parts)))
    assert found - listed == set(), "packages missing from pyproject.toml"
    assert listed - found == set(), "pyproject.toml lists packages that do not exist"


def test_every_public_name_resolves_to_its_defining_class() -> None:
    import importlib

    import pagedllm

    expected = {
        "LLM": "pagedllm.engine.llm",
        "SamplingParams": "pagedllm.core.sampling_params",
        "EngineConfig": "pagedllm.core.config",
        "RequestOutput": "pagedllm.engine.outputs",
        "CompletionOutput": "pagedllm.engine.outputs",
    }
    assert sorted(pagedllm.__all__) == sorted([*expected, "__version__"])
    for name, module_name in expected.items():
        assert getattr(pagedllm, name) is getattr(importlib.import_module(module_name), name)
