"""datasette's guards for the plugin API: every hookspec is documented in
docs/plugins.md (purpose, arguments, return value, when it is called, an
example) and implemented by a test plugin; the compatibility policy and the walkthrough
exist and stay true to the code."""

from __future__ import annotations

import importlib
import inspect
import re
import textwrap
from pathlib import Path

import pluggy
import pytest

from pagedllm.plugins import API_VERSION, API_VERSION_ATTR, PROJECT_NAME, hookspecs

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "plugins.md"
SECTION_PARTS = ("**Purpose.**", "**Arguments.**", "**Returns.**", "**When it is called.**", "**Example")


def _hook_names() -> list[str]:
    return sorted(
        name for name, fn in vars(hookspecs).items() if callable(fn) and getattr(fn, "pagedllm_spec", None) is not None
    )


def _sections() -> dict[str, str]:
    """`### `name`` heading -> its text, up to the next heading of level <= 3."""
    text = DOCS.read_text()
    sections = {}
    for match in re.finditer(r"^### `(\w+)`\n(.*?)(?=^#{1,3} |\Z)", text, flags=re.M | re.S):
        sections[match.group(1)] = match.group(2)
    return sections


def _h2(title: str) -> str:
    text = DOCS.read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"docs/plugins.md has no '## {title}' section"
    return match.group(1)


@pytest.mark.parametrize("hook_name", _hook_names())
def test_every_hookspec_is_documented_with_an_example(hook_name: str) -> None:
    section = _sections().get(hook_name)
    assert section is not None, f"docs/plugins.md has no '### `{hook_name}`' section"
    for part in SECTION_PARTS:
        assert part in section, f"the {hook_name} section lacks {part}"
    examples = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert any(f"def {hook_name}(" in example for example in examples), f"no example implements {hook_name}"


def test_docs_document_no_hook_that_does_not_exist() -> None:
    assert sorted(_sections()) == _hook_names()


def test_every_python_block_in_the_docs_is_valid_python() -> None:
    for block in re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S):
        compile(textwrap.dedent(block), str(DOCS), "exec")


def _test_plugin_manager() -> pluggy.PluginManager:
    """A plugin manager holding every test plugin and nothing else: the installed
    test distribution and each module-level class of a test module whose methods
    carry ``@hookimpl`` (the plugins that fixtures ``pm.register``). Built-ins and
    the example packages are left out: a hook only they implement has no test."""
    pm = pluggy.PluginManager(PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    pm.register(importlib.import_module("pagedllm_test_plugin"), name="pagedllm-test-plugin")
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        if "@hookimpl" not in path.read_text():
            continue
        module = importlib.import_module(path.stem)  # tests/ is on sys.path (conftest)
        for name, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == module.__name__ and any(
                getattr(attr, f"{PROJECT_NAME}_impl", None) is not None for attr in vars(value).values()
            ):
                pm.register(value, name=f"{path.stem}.{name}")
    return pm


@pytest.fixture(scope="module")
def plugins_under_test() -> pluggy.PluginManager:
    return _test_plugin_manager()


@pytest.mark.parametrize("hook_name", _hook_names())
def test_every_hookspec_is_implemented_by_a_test_plugin(
    hook_name: str, plugins_under_test: pluggy.PluginManager
) -> None:
    hook_caller = getattr(plugins_under_test.hook, hook_name)
    implementers = [plugins_under_test.get_name(impl.plugin) for impl in hook_caller.get_hookimpls()]
    assert implementers, (
        f"no test plugin implements {hook_name}: add it to tests/plugins/pagedllm-test-plugin or to a "
        "module-level plugin class that a test registers"
    )


def test_compatibility_policy_names_the_mechanism_and_what_breaks() -> None:
    policy = _h2("Compatibility")
    assert f"{API_VERSION_ATTR} = \">=1.0,<2\"" in policy
    for topic in ("breaking change", "Minor bump", "Patch bump", "Deprecation", "strict", "undeclared"):
        assert topic in policy, topic
    assert f"plugin API {API_VERSION}" in policy  # the example message quotes the current version


def test_walkthrough_builds_on_the_example_packages() -> None:
    walkthrough = _h2("Your first plugin in ten minutes")
    for package in ("pagedllm-example-model", "pagedllm-example-attention", "pagedllm-example-platform"):
        assert package in walkthrough, package
        assert (ROOT / "examples" / "plugins" / package / "README.md").is_file()
    commands = ("pagedllm plugins list", "pagedllm plugins new", "pagedllm serve --config", "PAGEDLLM_TRACE_PLUGINS=1")
    for command in commands:
        assert command in walkthrough, command
