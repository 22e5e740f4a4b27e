"""Per-plugin configuration (issue 18.1): a plugin declares a pydantic model of
its options; users set them in the config file, the environment or by flag;
they are validated when the plugins load (a ConfigError names the plugin, the
key, the value and what is allowed) and reach the plugin's component in the
process that builds it: `LLM`'s own process, the engine-core process `serve`
spawns, each rank of the `mp` executor."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from helpers.server import start_server
from pagedllm_test_plugin.options import TestPluginOptions
from pydantic import BaseModel, Field
from pydantic_settings import BaseSettings

from pagedllm import LLM
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError, PluginError
from pagedllm.entrypoints.cli import build_parser, main, serve_config
from pagedllm.plugins import PluginManager, RegisterConfigFn, RegisterFn, get_plugin_manager, hookimpl

TEST_PLUGIN = "pagedllm_test_plugin"
DEFAULTS = {"record_path": None, "label": "default", "scale": 1, "mode": "exact", "tiers": []}
ENGINE_ARGS: dict[str, Any] = dict(model="tiny", dtype="float32", num_kv_blocks=16, attention_backend="test_echo")


class FixtureOptions(BaseSettings):
    """A plugin's options as a pydantic *settings* model: it must not read
    the environment on its own (the options come from plugins.config only)."""

    endpoint: str = "local"
    retries: int = Field(3, ge=0, le=10)


class HookConfiguredPlugin:
    """Declares its options through the hook, and registers one component."""

    @hookimpl
    def register_plugin_config(self, register: RegisterConfigFn) -> None:
        register(FixtureOptions)

    @hookimpl
    def register_kv_connectors(self, register: RegisterFn) -> None:
        register("fixture_store", "pagedllm_test_plugin.connector:DelayedFreeConnector")


class OtherOptions(BaseModel):
    level: Literal["low", "high"] = "low"


class TwoModelsPlugin:
    """Declares one model as the module attribute and another by the hook."""

    PAGEDLLM_PLUGIN_CONFIG = OtherOptions

    @hookimpl
    def register_plugin_config(self, register: RegisterConfigFn) -> None:
        register(FixtureOptions)


@pytest.fixture
def pm() -> PluginManager:
    """A private manager (its own entry points), so no test leaves options behind."""
    manager = PluginManager()
    manager.load()
    return manager


@pytest.fixture
def process_options() -> Iterator[None]:
    """For tests that go through the process-wide manager (LLM): its options
    are reset afterwards."""
    yield
    get_plugin_manager().load(config={})


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- declaring and validating ------------------------------------------


def test_module_attribute_model_gives_defaults_when_nothing_is_set(pm: PluginManager) -> None:
    options = pm.plugin_config(TestPluginOptions)
    assert isinstance(options, TestPluginOptions) and options.model_dump() == DEFAULTS
    assert pm.plugin_config(TEST_PLUGIN) is options
    assert pm.plugin_config_model(TEST_PLUGIN) is TestPluginOptions
    assert pm.plugin_config("builtin") is None and pm.plugin_config_model("builtin") is None


def test_given_options_are_validated_into_the_model(pm: PluginManager) -> None:
    pm.load(config={TEST_PLUGIN: {"label": "x", "scale": 8, "mode": "fast", "tiers": [2, 3]}})
    assert pm.plugin_config(TestPluginOptions).model_dump() == {**DEFAULTS, "label": "x", "scale": 8, "mode": "fast",
                                                                "tiers": [2, 3]}
    pm.load()  # no config: the options given before stay
    assert pm.plugin_config(TestPluginOptions).scale == 8
    pm.load(config={})
    assert pm.plugin_config(TestPluginOptions).scale == 1


@pytest.mark.parametrize(("values", "key", "value", "allowed"), [
    ({"scale": 9}, "scale", 9, ">= 1 and <= 8"),
    ({"scale": 0}, "scale", 0, ">= 1 and <= 8"),
    ({"mode": "slow"}, "mode", "slow", "'fast', 'exact'"),
    ({"tiers": "[1, 'a']"}, "tiers", "[1, 'a']", "Input should be a valid list"),
    ({"scal": 2}, "scal", 2, f"an option of plugin '{TEST_PLUGIN}': record_path, label, scale, mode, tiers"),
])
def test_a_bad_option_is_a_config_error_naming_plugin_key_value_and_allowed(
    pm: PluginManager, values: dict[str, Any], key: str, value: Any, allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        pm.load(config={TEST_PLUGIN: values})
    assert (info.value.key, info.value.value, info.value.allowed) == (f"plugins.config.{TEST_PLUGIN}.{key}", value,
                                                                      allowed)
    # The manager keeps refusing: a component asking for its options fails the same way.
    with pytest.raises(ConfigError, match=re.escape(f"plugins.config.{TEST_PLUGIN}.{key}=")):
        pm.plugin_config(TestPluginOptions)


def test_options_for_an_unknown_plugin_name_list_the_loaded_plugins(pm: PluginManager) -> None:
    with pytest.raises(ConfigError) as info:
        pm.load(config={"pagedllm_tset_plugin": {"scale": 2}})
    assert info.value.key == "plugins.config.pagedllm_tset_plugin"
    loaded = sorted(plugin.name for plugin in pm.plugins())
    assert info.value.allowed == "options of a loaded plugin; loaded plugins: " + ", ".join(loaded)
    assert TEST_PLUGIN in loaded and "builtin" in loaded


def test_options_for_a_plugin_without_a_model_are_an_error(pm: PluginManager) -> None:
    with pytest.raises(ConfigError) as info:
        pm.load(config={"builtin": {"x": 1}})
    assert (info.value.key, info.value.allowed) == ("plugins.config.builtin",
                                                    "no options: plugin 'builtin' declares no config model")


def test_options_for_an_installed_but_disabled_plugin_are_ignored(pm: PluginManager,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    pm.load(disabled=[TEST_PLUGIN], config={TEST_PLUGIN: {"scale": 99}})
    assert f"options for plugin '{TEST_PLUGIN}' ignored: it is installed but not loaded" in caplog.text
    with pytest.raises(PluginError, match="no registered plugin declares it"):
        pm.plugin_config(TestPluginOptions)


def test_names_match_whatever_the_case_and_dashes(pm: PluginManager) -> None:
    # Env var names arrive lowercased, and cannot hold a dash.
    pm.load(config={"PAGEDLLM-TEST-PLUGIN": {"label": "loose"}})
    assert pm.plugin_config(TestPluginOptions).label == "loose"


def test_hook_declared_settings_model_is_validated_and_found_by_its_class(
    pm: PluginManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("ENDPOINT", "from-the-environment")  # a BaseSettings would read it if constructed
    pm.register(HookConfiguredPlugin(), name="hook_configured")
    assert pm.plugin_config(FixtureOptions).model_dump() == {"endpoint": "local", "retries": 3}
    pm.load(config={"hook_configured": {"retries": "7"}})
    assert pm.plugin_config(FixtureOptions).model_dump() == {"endpoint": "local", "retries": 7}
    # The registration knows its plugin: the component's options follow it.
    assert pm.component_config("kv_connector", "fixture_store") is pm.plugin_config(FixtureOptions)
    assert pm.component_config("attention_backend", "test_echo") is pm.plugin_config(TestPluginOptions)
    assert pm.component_config("attention_backend", "torch_native") is None
    with pytest.raises(ConfigError) as info:
        pm.load(config={"hook_configured": {"retries": 11}})
    assert (info.value.key, info.value.value, info.value.allowed) == (
        "plugins.config.hook_configured.retries", 11, ">= 0 and <= 10")
    pm.unregister(name="hook_configured")
    with pytest.raises(ConfigError, match=r"plugins\.config\.hook_configured="):
        pm.plugin_config(TestPluginOptions)  # its options now name no loaded plugin


def test_two_different_models_declared_is_a_plugin_error(pm: PluginManager) -> None:
    pm.register(TwoModelsPlugin(), name="two_models")
    with pytest.raises(PluginError, match="'two_models' declares more than one config model"):
        pm.plugin_config("two_models")
    with pytest.raises(PluginError, match="'two_models' declares more than one config model"):
        pm.load(config={"two_models": {"level": "high"}})


class RequiredOptions(BaseModel):
    url: str  # no default: the user must set it


class RequiredOptionPlugin:
    PAGEDLLM_PLUGIN_CONFIG = RequiredOptions


def test_a_required_option_fails_only_where_the_plugin_is_used(pm: PluginManager) -> None:
    pm.register(RequiredOptionPlugin(), name="needs_url")
    pm.load(config={})  # installed but unused and unset: loading still works
    with pytest.raises(ConfigError) as info:
        pm.plugin_config(RequiredOptions)  # its component asks: now it is an error
    assert (info.value.key, info.value.allowed) == ("plugins.config.needs_url.url", "Field required")
    pm.load(config={"needs_url": {"url": "http://store"}})
    assert pm.plugin_config(RequiredOptions) == RequiredOptions(url="http://store")


class NotAModelPlugin:
    PAGEDLLM_PLUGIN_CONFIG = dict  # not a pydantic model

    @hookimpl
    def register_routers(self, register: RegisterFn) -> None:
        register("fixture_router", "pagedllm.routers.round_robin:RoundRobinPolicy")


def test_an_invalid_declaration_is_a_load_error_and_fatal_in_strict_mode(pm: PluginManager) -> None:
    pm.register(NotAModelPlugin(), name="not_a_model")
    message = ("PluginError: plugin 'not_a_model' declares config model <class 'dict'>, "
               "not a pydantic BaseModel subclass")
    assert [(e.plugin, e.error) for e in pm.load_errors] == [("not_a_model", message)]
    assert "fixture_router" in pm.routers  # its components still load
    with pytest.raises(PluginError, match=re.escape(message.removeprefix("PluginError: "))):
        pm.load(strict=True)


# ---- the sources: file, env, flag ----------------------------------------


def test_flag_beats_env_beats_file_key_by_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               pm: PluginManager) -> None:
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(f"plugins:\n  config:\n    {TEST_PLUGIN}: {{label: file, scale: 2, mode: fast}}\n")
    monkeypatch.setenv(f"PAGEDLLM_PLUGINS__CONFIG__{TEST_PLUGIN.upper()}__SCALE", "5")
    monkeypatch.setenv(f"PAGEDLLM_PLUGINS__CONFIG__{TEST_PLUGIN.upper()}__TIERS", "[4, 6]")
    args = build_parser().parse_args(["serve", "--config", str(config_file),
                                      "--plugin-config", f'{TEST_PLUGIN}={{"scale": 7}}',
                                      "--plugin-config", f'{TEST_PLUGIN}={{"label": "flag"}}'])
    config = serve_config(args)
    pm.load(config=config.plugins.config)
    assert pm.plugin_config(TestPluginOptions).model_dump() == {**DEFAULTS, "label": "flag", "scale": 7,
                                                                "mode": "fast", "tiers": [4, 6]}
    monkeypatch.delenv(f"PAGEDLLM_PLUGINS__CONFIG__{TEST_PLUGIN.upper()}__TIERS")
    pm.load(config=serve_config(build_parser().parse_args(["serve", "--config", str(config_file)])).plugins.config)
    assert pm.plugin_config(TestPluginOptions).model_dump() == {**DEFAULTS, "label": "file", "scale": 5,
                                                                "mode": "fast"}


def test_llm_keyword_sets_the_plugin_options() -> None:
    config = EngineConfig.from_flat(plugin_config={TEST_PLUGIN: {"scale": 3}})
    assert config.plugins.config == {TEST_PLUGIN: {"scale": 3}}


@pytest.mark.parametrize("flag", ["pagedllm_test_plugin", 'pagedllm_test_plugin={"scale": ', "=[1]",
                                  'pagedllm_test_plugin=[1]'])
def test_a_malformed_plugin_config_flag_is_a_usage_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--plugin-config", flag]) == 2
    assert "--plugin-config" in capsys.readouterr().err


# ---- plugins list -------------------------------------------------------


def test_plugins_list_shows_each_plugins_effective_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    private = PluginManager()
    monkeypatch.setattr("pagedllm.plugins.get_plugin_manager", lambda: private)
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(f"plugins:\n  config:\n    {TEST_PLUGIN}: {{label: file, scale: 2}}\n")
    monkeypatch.setenv(f"PAGEDLLM_PLUGINS__CONFIG__{TEST_PLUGIN.upper()}__SCALE", "4")
    argv = ["plugins", "list", "--config", str(config_file), "--plugin-config", f'{TEST_PLUGIN}={{"mode": "fast"}}']
    assert main([*argv, "--json"]) == 0
    plugins = {row["name"]: row for row in json.loads(capsys.readouterr().out)["plugins"]}
    expected = {**DEFAULTS, "label": "file", "scale": 4, "mode": "fast"}
    assert plugins[TEST_PLUGIN]["config_model"] == "pagedllm_test_plugin.options:TestPluginOptions"
    assert plugins[TEST_PLUGIN]["options"] == expected
    assert plugins["builtin"]["config_model"] is None and plugins["builtin"]["options"] is None
    assert main(argv) == 0
    assert f"options: {json.dumps(expected)}" in capsys.readouterr().out


def test_plugins_list_with_a_bad_option_exits_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr("pagedllm.plugins.get_plugin_manager", PluginManager)
    assert main(["plugins", "list", "--plugin-config", f'{TEST_PLUGIN}={{"mode": "slow"}}']) == 1
    assert f"plugins.config.{TEST_PLUGIN}.mode='slow' is invalid; allowed: 'fast', 'exact'" in capsys.readouterr().err


# ---- reaching the components -------------------------------------------


def test_llm_hands_the_options_to_the_plugin_backend(tmp_path: Path, process_options: None) -> None:
    record = tmp_path / "record.jsonl"
    LLM(**ENGINE_ARGS, plugin_config={TEST_PLUGIN: {"record_path": str(record), "label": "llm", "scale": "2"}}
        ).engine_core.shutdown()
    records = _records(record)
    assert records and {r["pid"] for r in records} == {os.getpid()}
    assert all(r["options"] == {**DEFAULTS, "record_path": str(record), "label": "llm", "scale": 2} for r in records)


def test_llm_engine_core_process_and_front_end_build_the_same_options(tmp_path: Path, process_options: None) -> None:
    record = tmp_path / "record.jsonl"
    options = {"record_path": str(record), "label": "two-processes", "mode": "fast"}
    llm = LLM(**ENGINE_ARGS, multiprocess=True, plugin_config={TEST_PLUGIN: options})
    try:
        records = _records(record)
        assert records and os.getpid() not in {r["pid"] for r in records}  # built in the engine-core process
        assert all(r["options"] == {**DEFAULTS, **options} for r in records)
        # The front end's own plugin code (a grammar backend checking requests) sees the same.
        assert get_plugin_manager().plugin_config(TestPluginOptions).model_dump() == {**DEFAULTS, **options}
    finally:
        llm.shutdown()


@pytest.mark.parametrize("multiprocess", [False, True])
def test_llm_with_a_bad_option_fails_at_start_naming_plugin_and_key(multiprocess: bool, process_options: None) -> None:
    with pytest.raises(ConfigError) as info:
        LLM(**ENGINE_ARGS, multiprocess=multiprocess, plugin_config={TEST_PLUGIN: {"scale": 0}})
    assert str(info.value) == f"plugins.config.{TEST_PLUGIN}.scale=0 is invalid; allowed: >= 1 and <= 8"


def test_every_mp_rank_builds_the_same_options(tmp_path: Path, process_options: None) -> None:
    record = tmp_path / "record.jsonl"
    options = {"record_path": str(record), "label": "ranks", "tiers": [1, 2]}
    LLM(**ENGINE_ARGS, tensor_parallel_size=2, distributed_executor_backend="mp",
        plugin_config={TEST_PLUGIN: options}).engine_core.shutdown()
    records = _records(record)
    assert len({r["pid"] for r in records}) == 2 and os.getpid() not in {r["pid"] for r in records}
    assert all(r["options"] == {**DEFAULTS, **options} for r in records)


def test_serve_config_file_options_reach_the_backend_in_the_engine_core_process(tmp_path: Path) -> None:
    record = tmp_path / "record.jsonl"
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(
        f"device: {{attention_backend: test_echo}}\n"
        f"plugins:\n  config:\n    {TEST_PLUGIN}: {{record_path: {json.dumps(str(record))}, label: file, scale: 2}}\n"
    )
    env = {f"PAGEDLLM_PLUGINS__CONFIG__{TEST_PLUGIN.upper()}__SCALE": "3"}
    flags = ["--config", str(config_file), "--plugin-config", f'{TEST_PLUGIN}={{"mode": "fast"}}']
    with start_server("tiny", "--dtype", "float32", "--num-kv-blocks", "16", *flags, env=env) as server:
        engine_pids = set(server.descendants())
        records = _records(record)
    assert records
    pids = {r["pid"] for r in records}
    assert len(pids) == 1 and pids <= engine_pids and server.pid not in pids  # the engine core, not the API process
    assert all(r["options"] == {**DEFAULTS, "record_path": str(record), "label": "file", "scale": 3, "mode": "fast"}
               for r in records)


def test_serve_with_a_bad_option_exits_at_start_naming_plugin_and_key(tmp_path: Path) -> None:
    config_file = tmp_path / "engine.yaml"
    config_file.write_text(f"plugins:\n  config:\n    {TEST_PLUGIN}: {{scale: 99}}\n")
    result = subprocess.run(
        [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "tiny", "--config", str(config_file),
         "--port", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert f"error: plugins.config.{TEST_PLUGIN}.scale=99 is invalid; allowed: >= 1 and <= 8" in result.stderr
