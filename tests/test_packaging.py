"""The distribution lists every package of the source tree (a regular,
non-editable `pip install` ships only what pyproject.toml names), and
nothing of training/ (training code is not runtime code)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
NOT_SHIPPED = {"tests", "examples", "benchmarks", "training", "build", "docs"}
# What training code does and serving code never does: step an optimizer.
TRAINING_CODE = re.compile(r"torch\.optim\.|\.backward\(\)|optimizer\.step\(\)")


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


def _shipped_modules() -> list[Path]:
    """The `.py` files a wheel holds: those directly inside each listed package's folder."""
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    folders = [REPO_ROOT.joinpath(*name.split(".")[1:]) for name in pyproject["tool"]["setuptools"]["packages"]]
    return sorted(path for folder in folders for path in folder.glob("*.py"))


def test_training_code_is_not_in_the_distribution() -> None:
    training = sorted((REPO_ROOT / "training").rglob("*.py"))
    assert {p.relative_to(REPO_ROOT).as_posix() for p in training} >= {
        "training/tiny/train.py", "training/tiny/evaluate.py", "training/tiny/model_card.py",
        "training/tiny/tokenizer.py", "training/train_eagle.py",
    }
    assert all(TRAINING_CODE.search(p.read_text()) for p in (REPO_ROOT / "training").glob("**/train*.py"))
    shipped = _shipped_modules()
    assert not [p for p in shipped if "training" in p.relative_to(REPO_ROOT).parts]
    assert [p.relative_to(REPO_ROOT).as_posix() for p in shipped if TRAINING_CODE.search(p.read_text())] == []


def test_every_public_name_resolves_to_its_defining_class() -> None:
    import importlib

    import pagedllm

    expected = {
        "LLM": "pagedllm.engine.llm",
        "SamplingParams": "pagedllm.core.sampling_params",
        "EngineConfig": "pagedllm.core.config",
        "RequestOutput": "pagedllm.engine.outputs",
        "CompletionOutput": "pagedllm.engine.outputs",
        "LoRARequest": "pagedllm.lora.request",
    }
    assert sorted(pagedllm.__all__) == sorted([*expected, "__version__"])
    for name, module_name in expected.items():
        assert getattr(pagedllm, name) is getattr(importlib.import_module(module_name), name)
