"""`pagedllm plugins new NAME --kind attention|model|platform`: the generated
package pip-installs, and its own test passes (run as its author would)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedllm.entrypoints.cli import main as cli_main

KINDS = ("attention", "model", "platform")
PIP = [sys.executable, "-m", "pip"]


def _dist_name(kind: str) -> str:
    return f"pagedllm-generated-{kind}"


def test_generated_package_has_entry_point_hooks_readme_and_test(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["plugins", "new", "pagedllm-my-backend", "--kind", "attention", "--dir", str(tmp_path)]) == 0
    package = tmp_path / "pagedllm-my-backend"
    assert f"created {package}" in capsys.readouterr().out
    pyproject = tomllib.loads((package / "pyproject.toml").read_text())
    assert pyproject["project"]["name"] == "pagedllm-my-backend"
    assert pyproject["project"]["entry-points"]["pagedllm.plugins"] == {"pagedllm_my_backend": "pagedllm_my_backend"}
    init = (package / "pagedllm_my_backend" / "__init__.py").read_text()
    assert 'PAGEDLLM_API_VERSION = ">=1.0,<2"' in init
    assert "@hookimpl\ndef register_attention_backends(register: RegisterFn) -> None:" in init
    assert '"pagedllm_my_backend.backend:MyBackendBackend"' in init
    backend = (package / "pagedllm_my_backend" / "backend.py").read_text()
    assert "class MyBackendBackend(TorchNativeBackend):" in backend
    assert (package / "README.md").read_text().startswith("# pagedllm-my-backend\n")
    assert (package / "tests" / "test_pagedllm_my_backend.py").is_file()
    # Every generated module is valid Python.
    for source in package.rglob("*.py"):
        compile(source.read_text(), str(source), "exec")


def test_refuses_a_non_empty_folder_and_a_bad_name(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert cli_main(["plugins", "new", "taken", "--kind", "model", "--dir", str(tmp_path)]) == 1
    assert "a folder that does not exist yet or is empty" in capsys.readouterr().err
    assert cli_main(["plugins", "new", "9lives", "--kind", "model", "--dir", str(tmp_path)]) == 1
    assert "name='9lives' is invalid" in capsys.readouterr().err
    assert cli_main(["plugins", "new", "x", "--kind", "drafter"]) != 0  # argparse: not a kind yet


@pytest.fixture(scope="module")
def installed_packages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """One generated package per kind, pip-installed (editable) into this venv,
    uninstalled afterwards."""
    parent = tmp_path_factory.mktemp("generated")
    packages = {}
    for kind in KINDS:
        assert cli_main(["plugins", "new", _dist_name(kind), "--kind", kind, "--dir", str(parent)]) == 0
        packages[kind] = parent / _dist_name(kind)
    # NOTE: no build isolation: setuptools comes from this venv, so the test
    # needs no package index.
    editables = [arg for p in packages.values() for arg in ("-e", str(p))]
    install = [*PIP, "install", "-q", "--no-build-isolation", *editables]
    try:
        subprocess.run(install, check=True, capture_output=True, text=True, timeout=240)
        yield packages
    finally:
        subprocess.run([*PIP, "uninstall", "-y", "-q", *map(_dist_name, KINDS)], capture_output=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_generated_package_installs_and_its_own_test_passes(installed_packages: dict[str, Path], kind: str) -> None:
    package = installed_packages[kind]
    listed = subprocess.run([*PIP, "show", _dist_name(kind)], capture_output=True, text=True, timeout=60)
    assert "Version: 0.1.0" in listed.stdout
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:asyncio"],
        cwd=package,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 passed" in result.stdout
