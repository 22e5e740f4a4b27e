"""The versioned plugin API: a plugin declares ``PAGEDLLM_API_VERSION`` (a PEP 440
specifier) in the module its entry point names; one whose range excludes
``pagedllm.plugins.API_VERSION`` is skipped with a message naming both
versions, shown by ``pagedllm plugins list``, and fatal in strict mode."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedllm.core.errors import PluginError
from pagedllm.plugins import (
    API_VERSION,
    API_VERSION_ATTR,
    PluginManager,
    check_api_compatibility,
    get_plugin_manager,
    hookimpl,
)

INCOMPATIBLE_RANGE = ">=2.0,<3"


def test_api_version_is_semver_and_the_attribute_is_named() -> None:
    from packaging.version import Version

    assert len(Version(API_VERSION).release) == 3
    assert API_VERSION_ATTR == "PAGEDLLM_API_VERSION"
    # Typed kinds (PluginKind, typed registries, AttentionCapabilities,
    # ModelForCausalLM) are additions: a minor version, still 1.x.
    assert Version(API_VERSION).major == 1 and Version(API_VERSION) >= Version("1.2")


@pytest.mark.parametrize(
    ("declared", "compatible"),
    [
        (">=1.0,<2", True),
        ("~=1.0", True),
        ("==1.0.0", True),  # an exact pin (checked against 1.0.0 below, not the current API_VERSION)
        (">=1.1,<2", False),  # needs a minor version this pagedllm does not have yet
        (INCOMPATIBLE_RANGE, False),
        ("<1.0", False),
    ],
)
def test_declared_range_is_checked_against_api_version(declared: str, compatible: bool) -> None:
    result = check_api_compatibility(SimpleNamespace(PAGEDLLM_API_VERSION=declared), "1.0.0")
    assert (result.declared, result.compatible) == (declared, compatible)
    if not compatible:
        assert result.reason == (
            f"the plugin supports pagedllm plugin API {declared!r}, this pagedllm provides plugin API 1.0.0"
        )


def test_undeclared_is_compatible_and_labelled() -> None:
    result = check_api_compatibility(SimpleNamespace())
    assert (result.declared, result.compatible, result.label) == (None, True, "undeclared")


@pytest.mark.parametrize(
    ("declared", "reason"), [("one point oh", "not a valid specifier"), (1.0, "not a version specifier string")]
)
def test_malformed_declaration_is_incompatible(declared: object, reason: str) -> None:
    result = check_api_compatibility(SimpleNamespace(PAGEDLLM_API_VERSION=declared))
    assert not result.compatible
    assert reason in (result.reason or "")


class _DeclaringPlugin:
    def __init__(self, api_range: str) -> None:
        self.PAGEDLLM_API_VERSION = api_range

    @hookimpl
    def register_kv_connectors(self, register) -> None:  # type: ignore[no-untyped-def]
        register("declaring_connector", "nowhere.kv:Connector")


def test_registering_an_incompatible_plugin_object_is_refused() -> None:
    pm = get_plugin_manager()
    message = f"supports pagedllm plugin API '>=2.0,<3', this pagedllm provides plugin API {API_VERSION}"
    with pytest.raises(PluginError, match=re.escape(message)):
        pm.register(_DeclaringPlugin(INCOMPATIBLE_RANGE), name="too-new")
    assert "declaring_connector" not in pm.registry("kv_connector")


def test_compatible_plugin_object_registers_and_reports_its_range() -> None:
    pm = get_plugin_manager()
    pm.register(_DeclaringPlugin(">=1.0,<2"), name="fits")
    try:
        [info] = [p for p in pm.plugins() if p.name == "fits"]
        assert info.api_range == ">=1.0,<2"
        assert pm.api_compatibility("fits").label == ">=1.0,<2 (compatible)"
        assert "declaring_connector" in pm.registry("kv_connector")
    finally:
        pm.unregister(name="fits")


# ---- through a real (unpacked) distribution and its entry point ----------------


@pytest.fixture
def incompatible_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A distribution `future-plugin 3.0.0` whose module declares API >=2.0,<3."""
    module = "pagedllm_future_plugin_xyz"
    (tmp_path / f"{module}.py").write_text(
        textwrap.dedent(
            f"""
            from pagedllm.plugins import hookimpl

            PAGEDLLM_API_VERSION = "{INCOMPATIBLE_RANGE}"

            @hookimpl
            def register_kv_connectors(register):
                register("future_connector", "{module}:Connector")
            """
        )
    )
    info = tmp_path / "future_plugin-3.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: future-plugin\nVersion: 3.0.0\n")
    (info / "entry_points.txt").write_text(f"[pagedllm.plugins]\nfuture = {module}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


EXPECTED_ERROR = (
    "IncompatiblePluginAPI: the plugin supports pagedllm plugin API '>=2.0,<3', "
    f"this pagedllm provides plugin API {API_VERSION}; skipped"
)


def test_incompatible_plugin_is_skipped_and_reported(incompatible_site: Path, caplog: pytest.LogCaptureFixture) -> None:
    pm = PluginManager()
    with caplog.at_level("ERROR", logger="pagedllm.plugins"):
        pm.load()
    [error] = [e for e in pm.load_errors if e.plugin == "future"]
    expected = ("future-plugin 3.0.0", EXPECTED_ERROR, INCOMPATIBLE_RANGE)
    assert (error.distribution, error.error, error.api_range) == expected
    assert "skipped plugin 'future' from future-plugin 3.0.0" in caplog.text
    assert "future" not in [p.name for p in pm.plugins()]
    assert "future_connector" not in pm.registry("kv_connector")
    assert "sdpa" in pm.registry("attention_backend")  # the compatible plugins still load


def test_incompatible_plugin_fails_in_strict_mode(incompatible_site: Path) -> None:
    with pytest.raises(PluginError) as info:
        PluginManager().load(strict=True)
    assert str(info.value) == (
        f"plugin 'future' (future-plugin 3.0.0) failed to load: {EXPECTED_ERROR} (plugins.strict is set)"
    )


def test_plugins_list_shows_the_skipped_plugin(incompatible_site: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(incompatible_site), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "pagedllm.entrypoints.cli", "plugins", "list"]
    as_json = subprocess.run([*command, "--json"], env=env, capture_output=True, text=True, timeout=60, check=True)
    payload = json.loads(as_json.stdout)
    assert {"plugin": "future", "distribution": "future-plugin 3.0.0", "error": EXPECTED_ERROR,
            "api_range": INCOMPATIBLE_RANGE} in payload["load_errors"]
    assert "future" not in [p["name"] for p in payload["plugins"]]

    as_text = subprocess.run(command, env=env, capture_output=True, text=True, timeout=60, check=True)
    assert f"  future (future-plugin 3.0.0): {EXPECTED_ERROR}" in as_text.stdout.splitlines()
