"""The manual cannot drift from the code: the generated reference pages
(docs/gen_reference.py) have an entry for every `EngineConfig` field, every
`pagedllm` flag, every plugin hook and every HTTP route, each found here by
walking the code itself; and the hand-written pages keep the lists the issue
found stale (config sections, routes, plugin kinds, the shipped models'
perplexity) whole. Each check is also run on a page with one entry removed,
to show it names exactly what is missing."""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from packaging.version import Version

from pagedllm.core.config import EngineConfig
from pagedllm.entrypoints.cli import build_parser
from pagedllm.plugins import API_VERSION, hookspecs
from pagedllm.plugins.kinds import PluginKind

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README_MAX_LINES = 200
HOOKS_OF_API_1_0 = sorted([
    "on_engine_start", "register_attention_backends", "register_drafters", "register_grammar_backends",
    "register_kv_connectors", "register_models", "register_platforms",
])


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_reference"] = module
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def _sections(page: str) -> dict[str, str]:
    """`## `title`` heading -> its text up to the next such heading."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^## `([^`]+)`\n(.*?)(?=^## |\Z)", page, flags=re.M | re.S)}


# ---- what the code has, found without the generator --------------------------------


def _config_fields() -> list[tuple[str, str]]:
    return [
        (section, key)
        for section, field in EngineConfig.model_fields.items()
        for key in field.annotation.model_fields  # type: ignore[union-attr]
    ]


def _cli_options() -> dict[str, list[str]]:
    """`pagedllm ...` command -> every option string (and positional) it takes."""
    options: dict[str, list[str]] = {}

    def walk(command: str, parser: argparse.ArgumentParser) -> None:
        options[command] = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{command} {name}", sub)
            elif not isinstance(action, argparse._HelpAction):
                options[command] += action.option_strings or [action.metavar or action.dest]

    walk("pagedllm", build_parser())
    return options


def _hook_names() -> list[str]:
    return sorted(n for n, fn in vars(hookspecs).items() if callable(fn) and getattr(fn, "pagedllm_spec", None))


# ---- the checks: each returns what the page lacks --------------------------------


def missing_config_entries(page: str) -> list[str]:
    missing = []
    for section, key in _config_fields():
        row = next((line for line in page.splitlines() if line.startswith(f"| `{section}.{key}` |")), None)
        env = f"PAGEDLLM_{section.upper()}__{key.upper()}"
        if row is None or env not in row:
            missing.append(f"{section}.{key}")
    return missing


def missing_cli_entries(page: str) -> list[str]:
    sections = _sections(page)
    missing = []
    for command, option_strings in _cli_options().items():
        rows = [line.split("|")[1] for line in sections.get(command, "").splitlines() if line.startswith("| `")]
        for option in option_strings:
            if not any(re.search(rf"`(.*, )?{re.escape(option)}(, .*)?`", row) for row in rows):
                missing.append(f"{command} {option}")
    return missing


def missing_hook_entries(page: str) -> list[str]:
    sections = _sections(page)
    missing = []
    for name in _hook_names():
        text = sections.get(name, "")
        added = re.search(r"Added in plugin API (\d+\.\d+\.\d+)\.", text)
        if f"def {name}(" not in text or added is None or Version(added.group(1)) > Version(API_VERSION):
            missing.append(name)
    return missing


def missing_route_entries(page: str, document: dict[str, Any]) -> list[str]:
    sections = _sections(page)
    return [
        f"{method.upper()} {path}"
        for path, item in document["paths"].items()
        for method in item
        if f"{method.upper()} {path}" not in sections
    ]


@pytest.fixture(scope="module")
def openapi_document() -> dict[str, Any]:
    return gen.openapi_document()


# ---- the generated reference pages --------------------------------


def test_every_config_field_has_its_type_default_env_and_flag_in_the_reference() -> None:
    page = gen.config_page()
    assert missing_config_entries(page) == []
    row = next(line for line in page.splitlines() if line.startswith("| `cache.num_kv_blocks` |"))
    assert row == (
        "| `cache.num_kv_blocks` | `int \\| None` | `None` | `PAGEDLLM_CACHE__NUM_KV_BLOCKS`<br>`--num-kv-blocks`<br>"
        "`num_kv_blocks, num_gpu_blocks_override` | Overrides the number of KV blocks computed from memory. "
        "With several KV cache groups (sliding-window layers beside full ones) it is the blocks of the pool "
        "they share, as vLLM's num_gpu_blocks_override. |"
    )
    row = next(line for line in page.splitlines() if line.startswith("| `parallel.tensor_parallel_size` |"))
    assert "`--tensor-parallel-size, -tp`" in row and "`tensor_parallel_size`" in row


def test_every_cli_flag_of_every_command_is_in_the_reference() -> None:
    page = gen.cli_page()
    assert missing_cli_entries(page) == []
    assert {"pagedllm serve", "pagedllm plugins list", "pagedllm bench serve", "pagedllm bench spec"} <= set(
        _sections(page)
    )


def test_every_hook_has_its_signature_and_the_api_version_that_added_it() -> None:
    page = gen.hooks_page()
    assert missing_hook_entries(page) == []
    versions = gen.hook_versions()
    assert versions["register_executors"] == "1.3.0" and versions["register_stat_loggers"] == "1.7.0"
    # A hook that plugins/compat.py's version history never names is taken to be
    # from 1.0: only the 1.0 hooks may be, so a new hook must enter the history.
    assert sorted(name for name, version in versions.items() if version == "1.0.0") == HOOKS_OF_API_1_0
    assert "def register_stat_loggers(register: RegisterFn) -> None" in page


def test_every_route_of_the_openapi_document_is_in_the_reference(openapi_document: dict[str, Any]) -> None:
    page = gen.routes_page(openapi_document)
    assert missing_route_entries(page, openapi_document) == []
    assert "GET /v1/kv_events" in _sections(page)


@pytest.mark.parametrize(
    ("build", "dropped_line", "expected"),
    [
        ("config", "| `cache.block_size` |", ["cache.block_size"]),
        ("cli", "| `--max-num-seqs` |", ["pagedllm serve --max-num-seqs"]),
        ("hooks", "Added in plugin API 1.3.0.", ["register_executors"]),
    ],
)
def test_a_reference_page_missing_an_entry_fails_naming_it(build: str, dropped_line: str, expected: list[str]) -> None:
    page = getattr(gen, f"{build}_page")()
    planted = "\n".join(line for line in page.splitlines() if not line.startswith(dropped_line))
    assert planted != page
    check = {"config": missing_config_entries, "cli": missing_cli_entries, "hooks": missing_hook_entries}[build]
    assert check(planted) == expected


def test_a_routes_page_missing_a_route_fails_naming_it(openapi_document: dict[str, Any]) -> None:
    planted = gen.routes_page(openapi_document).replace("## `GET /v1/kv_events`", "## (dropped)")
    assert missing_route_entries(planted, openapi_document) == ["GET /v1/kv_events"]


def test_the_site_home_page_is_the_readme_with_site_links() -> None:
    home = gen.front_page()
    assert "](docs/" not in home and "](quickstart.md)" in home


# ---- the hand-written pages --------------------------------


def test_readme_is_a_front_page_of_at_most_200_lines() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert readme.index("make serve") < readme.index("## ")  # the two commands come first
    for page in sorted(DOCS.glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"README.md does not link {page.name}"


def test_configuration_page_names_every_config_section() -> None:
    page = (DOCS / "configuration.md").read_text()
    assert [s for s in EngineConfig.model_fields if f"| `{s}` |" not in page] == []


def test_serving_page_lists_every_route(openapi_document: dict[str, Any]) -> None:
    page = (DOCS / "serving.md").read_text()
    assert [path for path in openapi_document["paths"] if f" {path}`" not in page] == []


def test_architecture_kind_table_covers_every_plugin_kind() -> None:
    from pagedllm.plugins.kinds import KIND_SPECS

    page = (DOCS / "architecture.md").read_text()
    hooks = {KIND_SPECS[kind].hook for kind in PluginKind}
    assert len(hooks) == len(PluginKind)
    assert sorted(hook for hook in hooks if not re.search(rf"^\| [^|]*\(`{hook}`\) \|", page, flags=re.M)) == []


@pytest.mark.parametrize(("folder", "alias"), [("pagedllm-tiny", "tiny"), ("pagedllm-tiny-draft", "tiny-draft")])
def test_shipped_model_perplexity_in_the_docs_is_the_model_cards(folder: str, alias: str) -> None:
    from pagedllm.model_registry.tiny import get_tiny_model_dir

    card = (get_tiny_model_dir(folder) / "README.md").read_text()
    perplexity = float(re.search(r"^\| trained \| [\d.]+ \| ([\d.]+) \|$", card, flags=re.M).group(1))  # type: ignore[union-attr]
    for page in (ROOT / "README.md", DOCS / "quickstart.md"):
        row = re.search(rf"^\| `{folder}` \(`{alias}`\)[^\n]*\| ([\d.]+) \|$", page.read_text(), flags=re.M)
        assert row is not None, f"{page.name} has no row for {folder}"
        assert row.group(1) == f"{perplexity:.1f}", page.name
