"""Model sources (plugin kind `model_source`): names that stand for a model
folder. The built-in source `tiny` resolves the shipped aliases; a plugin's
source resolves its own names, and the engine loads what it answers."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import ConfigError, PluginError
from pagedllm.entrypoints.cli import main as cli_main
from pagedllm.model_registry.interface import ModelSource
from pagedllm.model_registry.model_source import DEFAULT_MODEL, find_model, resolve_model_path
from pagedllm.model_registry.tiny import WEIGHTS_DIR
from pagedllm.plugins import PluginKind, PluginManager, RegisterFn, Registry, get_plugin_manager, hookimpl

ZOO_NAME = "zoo-tiny"


class ZooSource(ModelSource):
    """Knows one name; its folder is set by the fixture."""

    folder: str = ""

    def resolve(self, name: str) -> str | None:
        return self.folder if name == ZOO_NAME else None


class GreedySource(ModelSource):
    """Claims every name: registered after the builtin, it must not shadow `tiny`."""

    def resolve(self, name: str) -> str | None:
        return f"/greedy/{name}"


class ZooPlugin:
    @hookimpl
    def register_model_sources(self, register: RegisterFn) -> None:
        register("zoo", ZooSource)


class GreedyPlugin:
    @hookimpl
    def register_model_sources(self, register: RegisterFn) -> None:
        register("greedy", GreedySource)


class NotASourcePlugin:
    @hookimpl
    def register_model_sources(self, register: RegisterFn) -> None:
        register("broken", dict)  # not a ModelSource subclass


@pytest.fixture
def zoo_plugin(tmp_path: Path) -> Iterator[Path]:
    # A copy of the shipped model under a name only the plugin knows.
    folder = tmp_path / "zoo" / "my-tiny"
    shutil.copytree(WEIGHTS_DIR / "pagedllm-tiny", folder)
    ZooSource.folder = str(folder)
    pm = get_plugin_manager()
    pm.register(ZooPlugin(), name="zoo-plugin")
    yield folder
    pm.unregister(name="zoo-plugin")


def test_the_builtin_source_resolves_the_shipped_aliases() -> None:
    for alias, folder in [
        ("tiny", "pagedllm-tiny"),
        ("pagedllm-tiny", "pagedllm-tiny"),
        ("tiny-draft", "pagedllm-tiny-draft"),
        ("tiny-eagle", "pagedllm-tiny-eagle"),
    ]:
        assert resolve_model_path(alias) == str(WEIGHTS_DIR / folder)
    assert DEFAULT_MODEL == "tiny"
    assert resolve_model_path(None) == str(WEIGHTS_DIR / "pagedllm-tiny")
    # A name no source knows is a folder or hub id, used as given.
    assert find_model("org/some-model") is None
    assert resolve_model_path("org/some-model") == "org/some-model"
    assert resolve_model_path(Path("/models/x")) == os.fspath(Path("/models/x"))
    registry = get_plugin_manager().registry("model_source")
    assert [(reg.name, reg.source) for reg in registry.registrations()] == [("tiny", "builtin")]


def test_a_plugin_source_resolves_its_names_after_the_builtin(zoo_plugin: Path) -> None:
    pm = get_plugin_manager()
    assert resolve_model_path(ZOO_NAME) == str(zoo_plugin)
    assert resolve_model_path("org/some-model") == "org/some-model"
    pm.register(GreedyPlugin(), name="greedy-plugin")
    try:
        # Sources are asked in registration order: the builtin answers for
        # its names, the zoo for its own, the greedy source for the rest.
        assert resolve_model_path("tiny") == str(WEIGHTS_DIR / "pagedllm-tiny")
        assert resolve_model_path(ZOO_NAME) == str(zoo_plugin)
        assert resolve_model_path("org/some-model") == "/greedy/org/some-model"
        assert [(reg.name, reg.source) for reg in pm.model_sources.registrations()] == [
            ("tiny", "builtin"),
            ("zoo", "zoo-plugin"),
            ("greedy", "greedy-plugin"),
        ]
    finally:
        pm.unregister(name="greedy-plugin")
    assert resolve_model_path("org/some-model") == "org/some-model"


def test_the_engine_loads_the_folder_a_plugin_source_names(zoo_plugin: Path) -> None:
    llm = LLM(ZOO_NAME, num_kv_blocks=16, max_model_len=64)
    assert llm.engine_core.ready.model_path == str(zoo_plugin)
    shipped = LLM("tiny", num_kv_blocks=16, max_model_len=64)
    prompt = "def add(a, b):"
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    [ours] = llm.generate([prompt], params, use_tqdm=False)
    [reference] = shipped.generate([prompt], params, use_tqdm=False)
    assert ours.outputs[0].token_ids == reference.outputs[0].token_ids


def test_a_registration_that_is_not_a_model_source_is_refused() -> None:
    pm = PluginManager()
    pm.register(NotASourcePlugin(), name="not-a-source")
    assert find_model("tiny", pm) == str(WEIGHTS_DIR / "pagedllm-tiny")  # the builtin answers first
    with pytest.raises(PluginError, match="ModelSource"):
        find_model("other", pm)


def test_no_source_for_the_default_model_is_a_config_error() -> None:
    # A manager without a single model source (the builtin cannot be
    # unregistered, so this one only offers an empty registry).
    no_sources = SimpleNamespace(model_sources=Registry(PluginKind.MODEL_SOURCE))
    with pytest.raises(ConfigError, match="no model source knows the default 'tiny'"):
        resolve_model_path(None, no_sources)  # type: ignore[arg-type]
    assert resolve_model_path("tiny", no_sources) == "tiny"  # type: ignore[arg-type]


def test_plugins_list_shows_the_model_source_kind(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["plugins", "list", "--json"]) == 0
    components = json.loads(capsys.readouterr().out)["components"]
    assert components["model_source"] == [
        {
            "name": "tiny",
            "target": "pagedllm.model_registry.tiny:ShippedModelSource",
            "source": "builtin",
            "metadata": {},
        }
    ]
