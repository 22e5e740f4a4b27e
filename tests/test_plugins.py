"""The plugin platform: hooks, registries, entry points, guards."""

from __future__ import annotations

import importlib.metadata
import inspect
import logging
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from pagedllm_test_plugin.backend import TestEchoBackend
from torch import nn

from pagedllm.attention_backends.base import AttentionCapabilities
from pagedllm.core.errors import PluginError, UnknownComponentError
from pagedllm.model_registry.interface import ModelForCausalLM
from pagedllm.plugins import (
    API_VERSION,
    ATTENTION_BACKEND,
    KIND_HOOKS,
    KINDS,
    PluginKind,
    PluginLoadError,
    PluginManager,
    RegisterFn,
    Registration,
    get_plugin_manager,
    hookimpl,
    hookspecs,
)
from pagedllm.plugins.metadata import DrafterInfo, KVConnectorInfo, PlatformInfo, build_info

TEST_DIST = "pagedllm-test-plugin"
TEST_DIST_SOURCE = f"{TEST_DIST} {importlib.metadata.version(TEST_DIST)}"


class DuckTypedModel(nn.Module):
    """A plugin API 1.0 model: the four methods, no ModelForCausalLM base."""

    def forward(self, input_ids: Any, positions: Any, attn_metadata: Any) -> Any:
        return input_ids

    def compute_logits(self, hidden_states: Any) -> Any:
        return hidden_states

    def load_weights(self, weights: Any) -> set[str]:
        return set()

    def get_attention_layers(self) -> list[Any]:
        return []


class FixturePlugin:
    """A plugin registered without pip: one component of every kind."""

    def __init__(self) -> None:
        self.factory_calls = 0
        self.engine_configs: list[Any] = []

    def _model_factory(self) -> type:
        self.factory_calls += 1
        return type("FixtureForCausalLM", (DuckTypedModel,), {})

    @hookimpl
    def register_attention_backends(self, register: RegisterFn) -> None:
        register(
            "fixture_echo",
            "pagedllm_test_plugin.backend:TestEchoBackend",
            device_types=["cpu"],
            dtypes=["float32"],
        )

    @hookimpl
    def register_models(self, register: RegisterFn) -> None:
        register("FixtureForCausalLM", self._model_factory)

    @hookimpl
    def register_platforms(self, register: RegisterFn) -> None:
        register("fixture_platform", "pagedllm.platforms.cpu.platform:CpuPlatform", device_type="cpu")

    @hookimpl
    def register_drafters(self, register: RegisterFn) -> None:
        register("fixture_ngram", "pagedllm_fixture_drafter:NgramDrafter", needs_model=False)

    @hookimpl
    def register_grammar_backends(self, register: RegisterFn) -> None:
        register("fixture_regex", "pagedllm_fixture_grammar:RegexBackend")

    @hookimpl
    def register_kv_connectors(self, register: RegisterFn) -> None:
        register("fixture_storage", "pagedllm_fixture_kv:SharedStorageConnector", roles=["both"])

    @hookimpl
    def on_engine_start(self, config: Any) -> None:
        self.engine_configs.append(config)


@pytest.fixture
def fixture_plugin() -> Iterator[FixturePlugin]:
    pm = get_plugin_manager()
    plugin = FixturePlugin()
    pm.register(plugin, name="fixture-plugin")
    yield plugin
    pm.unregister(name="fixture-plugin")


def test_builtins_register_the_contract_targets_through_the_hooks() -> None:
    pm = get_plugin_manager()
    expected = {
        "model": {
            "LlamaForCausalLM": "pagedllm.model_registry.models.llama:LlamaForCausalLM",
            "MistralForCausalLM": "pagedllm.model_registry.models.llama:LlamaForCausalLM",
            "Qwen2ForCausalLM": "pagedllm.model_registry.models.qwen2:Qwen2ForCausalLM",
            "Qwen3ForCausalLM": "pagedllm.model_registry.models.qwen3:Qwen3ForCausalLM",
            "GptOssForCausalLM": "pagedllm.model_registry.models.gpt_oss:GptOssForCausalLM",
            "Qwen2MoeForCausalLM": "pagedllm.model_registry.models.qwen2_moe:Qwen2MoeForCausalLM",
            "Qwen3MoeForCausalLM": "pagedllm.model_registry.models.qwen3_moe:Qwen3MoeForCausalLM",
            "MixtralForCausalLM": "pagedllm.model_registry.models.mixtral:MixtralForCausalLM",
            "Phi3ForCausalLM": "pagedllm.model_registry.models.phi3:Phi3ForCausalLM",
            "Gemma2ForCausalLM": "pagedllm.model_registry.models.gemma2:Gemma2ForCausalLM",
            "Gemma3ForCausalLM": "pagedllm.model_registry.models.gemma3:Gemma3ForCausalLM",
            "GraniteForCausalLM": "pagedllm.model_registry.models.granite:GraniteForCausalLM",
            "Olmo2ForCausalLM": "pagedllm.model_registry.models.olmo2:Olmo2ForCausalLM",
            "DeepseekV2ForCausalLM": "pagedllm.model_registry.models.deepseek_v2:DeepseekV2ForCausalLM",
            "DeepseekV3ForCausalLM": "pagedllm.model_registry.models.deepseek_v2:DeepseekV3ForCausalLM",
        },
        "attention_backend": {
            "cpu": "pagedllm.attention_backends.torch_native:TorchNativeBackend",
            "triton": "pagedllm.attention_backends.triton:TritonBackend",
            "flash_attn": "pagedllm.attention_backends.flash_attn:FlashAttentionBackend",
        },
        "platform": {
            "cpu": "pagedllm.platforms.cpu.platform:CpuPlatform",
            "cuda": "pagedllm.platforms.cuda:CudaPlatform",
        },
        "grammar_backend": {
            "xgrammar": "pagedllm.structured_output.xgrammar_backend:XgrammarBackend",
        },
        "drafter": {
            "ngram": "pagedllm.spec_decode.ngram:NgramDrafter",
            "suffix": "pagedllm.spec_decode.suffix:SuffixDrafter",
            "draft_model": "pagedllm.spec_decode.draft_model:DraftModelDrafter",
            "eagle": "pagedllm.spec_decode.eagle:EagleDrafter",
            "eagle3": "pagedllm.spec_decode.eagle3:Eagle3Drafter",
        },
        "kv_connector": {
            "shared_storage": "pagedllm.kv_connectors.shared_storage:SharedStorageConnector",
            "cpu_offload": "pagedllm.kv_connectors.cpu_offload:CpuOffloadConnector",
        },
    }
    for kind, targets in expected.items():
        builtins = {r.name: r for r in pm.registry(kind).registrations() if r.source == "builtin"}
        assert {name: r.target for name, r in builtins.items()} == targets
    flash = pm.registry("attention_backend").get("flash_attn")
    assert flash.metadata["min_capability"] == (8, 0)
    assert flash.metadata["requires"] == ["flash_attn"]
    assert pm.registry("attention_backend").get("triton").metadata["min_capability"] == (7, 0)


def test_registered_plugin_adds_backend_and_model_found_by_the_registries(
    fixture_plugin: FixturePlugin,
) -> None:
    pm = get_plugin_manager()
    backends = pm.registry("attention_backend")
    assert "fixture_echo" in backends
    assert backends.get("fixture_echo") == Registration(
        "attention_backend",
        "fixture_echo",
        "pagedllm_test_plugin.backend:TestEchoBackend",
        "fixture-plugin",
        {"device_types": ["cpu"], "dtypes": ["float32"]},
        info=AttentionCapabilities(device_types=("cpu",), dtypes=("float32",)),
        plugin="fixture-plugin",  # the plugin whose options its component reads
    )
    assert backends.load("fixture_echo") is TestEchoBackend

    models = pm.registry("model")
    model_cls = models.load("FixtureForCausalLM")
    assert model_cls.__name__ == "FixtureForCausalLM"
    assert models.load("FixtureForCausalLM") is model_cls  # factory result cached
    assert fixture_plugin.factory_calls == 1
    assert models.get("FixtureForCausalLM").source == "fixture-plugin"
    for kind, name in [
        ("platform", "fixture_platform"),
        ("drafter", "fixture_ngram"),
        ("grammar_backend", "fixture_regex"),
        ("kv_connector", "fixture_storage"),
    ]:
        assert pm.registry(kind).get(name).source == "fixture-plugin"


def test_unregister_removes_the_plugin_components() -> None:
    pm = get_plugin_manager()
    pm.register(FixturePlugin(), name="short-lived")
    assert "fixture_echo" in pm.registry("attention_backend")
    pm.unregister(name="short-lived")
    assert "fixture_echo" not in pm.registry("attention_backend")
    assert "short-lived" not in [p.name for p in pm.plugins()]


def test_registration_does_not_import_the_target(fixture_plugin: FixturePlugin) -> None:
    drafters = get_plugin_manager().registry("drafter")
    assert drafters.get("fixture_ngram").metadata == {"needs_model": False}
    assert drafters.get("fixture_ngram").info == DrafterInfo(needs_model=False)
    assert "pagedllm_fixture_drafter" not in sys.modules
    expected = r"drafter 'fixture_ngram'.*registered by fixture-plugin.*ModuleNotFoundError"
    with pytest.raises(PluginError, match=expected):
        drafters.load("fixture_ngram")


def test_unknown_name_lists_the_registered_names() -> None:
    with pytest.raises(UnknownComponentError) as info:
        get_plugin_manager().registry("attention_backend").get("nope")
    assert info.value.kind == "attention_backend"
    assert {"cpu", "triton", "flash_attn"} <= set(info.value.known)
    assert "no attention_backend named 'nope'; registered: " in str(info.value)


def test_on_engine_start_reaches_every_plugin(fixture_plugin: FixturePlugin) -> None:
    config = object()
    get_plugin_manager().hook.on_engine_start(config=config)
    assert fixture_plugin.engine_configs == [config]


class DuplicateBuiltin:
    @hookimpl
    def register_attention_backends(self, register: RegisterFn) -> None:
        register("torch_native", "elsewhere:Backend")


class DuplicateOfInstalledPlugin:
    @hookimpl
    def register_models(self, register: RegisterFn) -> None:
        register("TestEchoForCausalLM", "elsewhere:Model")


def test_duplicate_name_is_an_error_naming_both_sources() -> None:
    pm = get_plugin_manager()
    pm.register(DuplicateBuiltin(), name="dup-plugin")
    try:
        with pytest.raises(PluginError) as info:
            pm.registry("attention_backend")
        assert str(info.value) == "attention_backend 'torch_native' registered by builtin and by dup-plugin"
    finally:
        pm.unregister(name="dup-plugin")
    assert pm.registry("attention_backend").get("torch_native").source == "builtin"


def test_a_renamed_builtin_is_selected_by_its_old_name() -> None:
    """The CPU attention backend was `torch_native` until it ran C kernels:
    the old name selects the same registration, the new one is listed."""
    registry = get_plugin_manager().registry("attention_backend")
    assert registry.get("torch_native") is registry.get("cpu")
    assert registry.load("torch_native") is registry.load("cpu")
    assert "torch_native" in registry and "torch_native" not in registry.names()
    assert registry.aliases() == {"torch_native": "cpu"}


class BadAliases:
    @hookimpl
    def register_attention_backends(self, register: RegisterFn) -> None:
        register("aliased_backend", "elsewhere:Backend", aliases="not_a_list")


def test_aliases_must_be_a_list_of_names() -> None:
    pm = get_plugin_manager()
    pm.register(BadAliases(), name="bad-aliases")
    try:
        assert "aliased_backend" not in pm.registry("attention_backend")
        assert [error.error for error in pm.load_errors if error.plugin == "bad-aliases"] == [
            "PluginError: bad-aliases registered attention_backend 'aliased_backend': "
            "metadata aliases='not_a_list' is invalid: a list of names"
        ]
    finally:
        pm.unregister(name="bad-aliases")


def test_duplicate_of_an_installed_distribution_names_its_version() -> None:
    pm = get_plugin_manager()
    pm.register(DuplicateOfInstalledPlugin(), name="dup-model")
    try:
        with pytest.raises(PluginError) as info:
            pm.registry("model")
        assert str(info.value) == (
            f"model 'TestEchoForCausalLM' registered by {TEST_DIST_SOURCE} and by dup-model"
        )
    finally:
        pm.unregister(name="dup-model")


class UnknownHookPlugin:
    @hookimpl
    def register_widgets(self, register: RegisterFn) -> None:  # no such hookspec
        pass


class BadTargetPlugin:
    @hookimpl
    def register_models(self, register: RegisterFn) -> None:
        register("BadForCausalLM", "no_colon_here")


def test_plugin_implementing_an_unknown_hook_is_rejected() -> None:
    pm = get_plugin_manager()
    with pytest.raises(PluginError, match=r"implements unknown hooks \['register_widgets'\]"):
        pm.register(UnknownHookPlugin(), name="widgets")
    assert "widgets" not in [p.name for p in pm.plugins()]


def test_registration_with_a_malformed_target_is_an_error() -> None:
    pm = get_plugin_manager()
    pm.register(BadTargetPlugin(), name="bad-target")
    try:
        expected = r"bad-target registered model 'BadForCausalLM' with target 'no_colon_here'"
        with pytest.raises(PluginError, match=expected):
            pm.registry("model")
    finally:
        pm.unregister(name="bad-target")


# ---- entry points --------------------------------------------------------


def test_installed_distribution_is_discovered_through_its_entry_point() -> None:
    pm = get_plugin_manager()
    assert (TEST_DIST_SOURCE.split()[1]) == "0.1.0"
    plugins = {p.name: p.source for p in pm.plugins()}
    assert plugins["pagedllm_test_plugin"] == TEST_DIST_SOURCE
    assert pm.registry("attention_backend").get("test_echo").source == TEST_DIST_SOURCE
    model = pm.registry("model").get("TestEchoForCausalLM")
    assert (model.target, model.source) == ("pagedllm_test_plugin.model:TestEchoForCausalLM", TEST_DIST_SOURCE)
    assert pm.load_errors == []


def _make_dist(root: Path, dist_name: str, version: str, entry_points: dict[str, str]) -> None:
    """A real (unpacked) distribution on sys.path: dist-info with an entry_points.txt."""
    info = root / f"{dist_name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: {version}\n")
    lines = ["[pagedllm.plugins]"] + [f"{name} = {value}" for name, value in entry_points.items()]
    (info / "entry_points.txt").write_text("\n".join(lines) + "\n")


@pytest.fixture
def fake_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Two extra distributions: one whose entry point cannot import, one that works."""
    module_name = f"pagedllm_ok_plugin_{abs(hash(str(tmp_path)))}"
    (tmp_path / f"{module_name}.py").write_text(
        textwrap.dedent(
            """
            from pagedllm.plugins import hookimpl

            @hookimpl
            def register_kv_connectors(register):
                register("ok_connector", "ok_plugin.kv:Connector")
            """
        )
    )
    _make_dist(tmp_path, "broken-plugin", "1.2.3", {"broken": "pagedllm_no_such_module_xyz"})
    _make_dist(tmp_path, "ok-plugin", "0.0.1", {"ok": module_name})
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


BROKEN_ERROR = PluginLoadError(
    "broken", "broken-plugin 1.2.3", "ModuleNotFoundError: No module named 'pagedllm_no_such_module_xyz'"
)


def test_broken_entry_point_is_recorded_and_not_fatal(fake_site: Path, caplog: pytest.LogCaptureFixture) -> None:
    pm = PluginManager()
    with caplog.at_level(logging.ERROR, logger="pagedllm.plugins"):
        pm.load()
    assert pm.load_errors == [BROKEN_ERROR]
    assert "failed to load plugin 'broken' from broken-plugin 1.2.3" in caplog.text
    # the others still load
    assert pm.registry("kv_connector").get("ok_connector").source == "ok-plugin 0.0.1"
    assert "test_echo" in pm.registry("attention_backend")


def test_broken_entry_point_is_fatal_in_strict_mode(fake_site: Path) -> None:
    pm = PluginManager()
    with pytest.raises(PluginError) as info:
        pm.load(strict=True)
    assert str(info.value) == (
        "plugin 'broken' (broken-plugin 1.2.3) failed to load: "
        "ModuleNotFoundError: No module named 'pagedllm_no_such_module_xyz' (plugins.strict is set)"
    )


def test_broken_entry_point_found_through_patched_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    broken = importlib.metadata.EntryPoint(name="ghost", value="pagedllm_ghost_module:plugin", group="pagedllm.plugins")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [broken])
    pm = PluginManager()
    pm.load()
    assert pm.load_errors == [
        PluginLoadError("ghost", "unknown", "ModuleNotFoundError: No module named 'pagedllm_ghost_module'")
    ]
    assert pm.registry("attention_backend").names() == ["cpu", "triton", "flash_attn"]


def test_allow_list_loads_only_the_enabled_plugins(fake_site: Path) -> None:
    pm = PluginManager()
    pm.load(enabled=["ok"], strict=True)  # the broken one is never imported, so strict passes
    assert [p.name for p in pm.plugins()] == ["builtin", "ok"]
    assert pm.load_errors == []
    assert "test_echo" not in pm.registry("attention_backend")


def test_deny_list_skips_a_plugin_and_builtins_always_load(fake_site: Path) -> None:
    pm = PluginManager()
    pm.load(disabled=["broken", "pagedllm_test_plugin", "builtin"], strict=True)
    names = {p.name for p in pm.plugins()}
    # Other installed plugins (the examples) load too; the denied ones do not.
    assert {"builtin", "ok"} <= names and not names & {"broken", "pagedllm_test_plugin"}
    assert "torch_native" in pm.registry("attention_backend")


def test_load_is_idempotent_and_reapplies_changed_lists(fake_site: Path) -> None:
    pm = PluginManager()
    pm.load(disabled=["broken"])
    first = pm.plugins()
    pm.load(disabled=["broken"])
    assert pm.plugins() == first
    assert "ok_connector" in pm.registry("kv_connector").names()
    pm.load(disabled=["broken", "ok"])
    assert "ok" not in [p.name for p in pm.plugins()]
    assert "ok_connector" not in pm.registry("kv_connector").names()
    pm.load(disabled=["broken"])
    assert "ok_connector" in pm.registry("kv_connector").names()


def test_trace_env_logs_every_hook_call(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("PAGEDLLM_TRACE_PLUGINS", "1")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    pm = PluginManager()
    with caplog.at_level(logging.INFO, logger="pagedllm.plugins"):
        pm.hook.on_engine_start(config="cfg")
        pm.registry("platform")
    assert "hook on_engine_start(config='cfg')" in caplog.text
    assert "hook register_platforms(" in caplog.text


# ---- guards --------------------------------------------------------------


def _hookspec_functions() -> dict[str, Any]:
    return {
        name: fn
        for name, fn in vars(hookspecs).items()
        if callable(fn) and getattr(fn, "pagedllm_spec", None) is not None
    }


def test_hookspecs_cover_every_kind_and_none_is_firstresult() -> None:
    specs = _hookspec_functions()
    # One register_* hook per kind, plus the lifecycle hook and the plugin's own options.
    assert set(specs) == {KIND_HOOKS[kind] for kind in KINDS} | {"on_engine_start", "register_plugin_config"}
    assert {"register_platforms", "register_attention_backends", "register_models", "register_drafters",
            "register_grammar_backends", "register_kv_connectors"} <= set(specs)
    for fn in specs.values():
        assert fn.pagedllm_spec["firstresult"] is False


@pytest.mark.parametrize("hook_name", sorted(_hookspec_functions()))
def test_every_hookspec_is_documented_and_typed(hook_name: str) -> None:
    fn = _hookspec_functions()[hook_name]
    doc = inspect.getdoc(fn) or ""
    assert ":param" in doc and ":return:" in doc and "Called" in doc, hook_name
    signature = inspect.signature(fn)
    assert signature.return_annotation == "None"
    assert all(p.annotation is not inspect.Parameter.empty for p in signature.parameters.values())


@pytest.mark.parametrize("hook_name", sorted(_hookspec_functions()))
def test_every_hookspec_is_exercised_by_a_test(hook_name: str) -> None:
    """datasette's guard: a hook nobody tests is a hook that silently breaks."""
    sources = "\n".join(p.read_text() for p in Path(__file__).parent.glob("test_*.py"))
    implemented = re.search(rf"def {hook_name}\(", sources)
    called = re.search(rf"\.hook\.{hook_name}\(", sources)
    assert implemented or called, f"no test implements or calls {hook_name}"


def test_api_version_is_semver() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", API_VERSION)


# ---- typed kinds ----------------------------------------------------------


def test_kinds_are_str_enum_members_with_typed_registries() -> None:
    pm = get_plugin_manager()
    assert PluginKind.MODEL == "model" and f"{PluginKind.ATTENTION_BACKEND}" == "attention_backend"
    assert ATTENTION_BACKEND is PluginKind.ATTENTION_BACKEND  # the 1.0 constant names remain
    assert pm.registry("model") is pm.registry(PluginKind.MODEL) is pm.models
    assert pm.registry("attention_backend") is pm.attention_backends
    assert pm.registry("platform") is pm.platforms
    assert pm.registry("drafter") is pm.drafters
    assert pm.registry("grammar_backend") is pm.grammar_backends
    assert pm.registry("kv_connector") is pm.kv_connectors
    with pytest.raises(PluginError, match=r"unknown plugin kind 'widget'; kinds: platform, attention_backend, model"):
        pm.registry("widget")


def test_builtin_metadata_becomes_typed_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    pm = PluginManager()  # the builtins registered under this environment
    assert pm.attention_backends.get("triton").info == AttentionCapabilities(
        device_types=("cuda",),
        min_capability=(7, 0),
        dtypes=("float32", "float16", "bfloat16"),
        max_head_size=256,
        block_size_multiple=16,
        requires=("triton",),
        supports_sliding_window=True,
        supports_logits_soft_cap=True,
        supports_sinks=True,
        supports_mla=True,
        kv_cache_dtypes=("float8_e4m3fn", "float8_e5m2"),
        kv_cache_dtype_min_capability=(("float8_e4m3fn", (8, 9)),),
    )
    assert pm.attention_backends.get("flash_attn").info.head_size_multiple == 8
    assert pm.drafters.get("eagle").info == DrafterInfo(needs_model=True)
    assert pm.kv_connectors.get("cpu_offload").info == KVConnectorInfo(roles=("both",), supports_tensor_parallel=True)
    assert pm.grammar_backends.get("xgrammar").info.requires == ("xgrammar",)
    assert pm.platforms.get("cuda").info == PlatformInfo(device_type="cuda")
    # None is "not given" (a default, not None where the default is a value)
    assert build_info(AttentionCapabilities, {"requires": None, "max_head_size": None}) == AttentionCapabilities()
    # torch dtypes are read as their names
    assert build_info(AttentionCapabilities, {"dtypes": [torch.float16, "bfloat16"]}).dtypes == ("float16", "bfloat16")


class MisspeltCapabilityPlugin:
    @hookimpl
    def register_attention_backends(self, register: RegisterFn) -> None:
        register("typo_backend", "pagedllm_test_plugin.backend:TestEchoBackend", min_capabilty=(8, 0))
        register("str_backend", "pagedllm_test_plugin.backend:TestEchoBackend", device_types="cuda")
        register("good_backend", "pagedllm_test_plugin.backend:TestEchoBackend", device_types=["cpu"])

    @hookimpl
    def register_drafters(self, register: RegisterFn) -> None:
        register("typo_drafter", "nowhere:Drafter", needs_target_hidden_states=False)

    @hookimpl
    def register_models(self, register: RegisterFn) -> None:
        register("KeyedForCausalLM", "nowhere:Model", dtypes=["float16"])


ACCEPTED_CAPABILITIES = (
    "device_types, min_capability, max_capability, dtypes, head_sizes, head_size_multiple, "
    "max_head_size, block_size_multiple, requires, supports_sliding_window, "
    "supports_logits_soft_cap, supports_sinks, supports_mla, kv_cache_dtypes, kv_cache_dtype_min_capability"
)


def test_misspelt_or_wrong_typed_metadata_is_a_load_error_naming_plugin_and_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pm = get_plugin_manager()
    pm.register(MisspeltCapabilityPlugin(), name="typo-plugin")
    try:
        with caplog.at_level(logging.WARNING, logger="pagedllm.plugins"):
            backends = pm.attention_backends
            drafters = pm.drafters
        # The bad registrations are left out; the plugin's good one and every other plugin stay.
        assert "good_backend" in backends and "torch_native" in backends and "test_echo" in backends
        assert "typo_backend" not in backends and "str_backend" not in backends
        assert "skipped a registration of plugin 'typo-plugin'" in caplog.text
        errors = [e for e in pm.load_errors if e.plugin == "typo-plugin"]
        assert errors == [
            PluginLoadError(
                "typo-plugin",
                "typo-plugin",
                "PluginError: typo-plugin registered attention_backend 'typo_backend': unknown metadata key "
                f"'min_capabilty' (did you mean 'min_capability'?); accepted keys: {ACCEPTED_CAPABILITIES}",
            ),
            PluginLoadError(
                "typo-plugin",
                "typo-plugin",
                "PluginError: typo-plugin registered attention_backend 'str_backend': metadata "
                "device_types='cuda' is invalid: expected a list of strings, got str",
            ),
            PluginLoadError(
                "typo-plugin",
                "typo-plugin",
                "PluginError: typo-plugin registered model 'KeyedForCausalLM': unknown metadata key "
                "'dtypes'; accepted keys: none",
            ),
        ]
        # Drafter metadata was free-form under plugin API 1.0: an unknown key is kept, with a warning.
        assert drafters.get("typo_drafter").info == DrafterInfo(extra={"needs_target_hidden_states": False})
        assert (
            "typo-plugin registered drafter 'typo_drafter': unknown metadata key 'needs_target_hidden_states'; "
            "accepted keys: needs_model; kept as free-form metadata (plugin API 1.0)"
        ) in caplog.text
    finally:
        pm.unregister(name="typo-plugin")
    assert not [e for e in pm.load_errors if e.plugin == "typo-plugin"]


def test_misspelt_metadata_is_raised_in_strict_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [])
    pm = PluginManager()
    pm.load(strict=True)
    pm.register(MisspeltCapabilityPlugin(), name="typo-plugin")
    with pytest.raises(PluginError) as info:
        pm.registry("attention_backend")
    assert str(info.value) == (
        "typo-plugin registered attention_backend 'typo_backend': unknown metadata key 'min_capabilty' "
        f"(did you mean 'min_capability'?); accepted keys: {ACCEPTED_CAPABILITIES} (plugins.strict is set)"
    )


class WrongBasePlugin:
    @hookimpl
    def register_attention_backends(self, register: RegisterFn) -> None:
        register("platform_as_backend", "pagedllm.platforms.cpu.platform:CpuPlatform")
        register("instance_factory", lambda: TestEchoBackend())

    @hookimpl
    def register_models(self, register: RegisterFn) -> None:
        register("HalfForCausalLM", HalfModel)
        register("DuckForCausalLM", DuckTypedModel)


class HalfModel(nn.Module):
    """Only forward: not a model for either API version."""

    def forward(self, input_ids: Any) -> Any:
        return input_ids


def test_loaded_target_must_subclass_the_kind_interface() -> None:
    pm = get_plugin_manager()
    pm.register(WrongBasePlugin(), name="wrong-base")
    try:
        with pytest.raises(PluginError) as info:
            pm.attention_backends.load("platform_as_backend")
        assert str(info.value) == (
            "attention_backend 'platform_as_backend' from pagedllm.platforms.cpu.platform:CpuPlatform (registered by "
            "wrong-base) is <class 'pagedllm.platforms.cpu.platform.CpuPlatform'>, not a subclass of "
            "pagedllm.attention_backends.base:AttentionBackend"
        )
        # A factory returns the class, not an instance.
        with pytest.raises(PluginError, match=r"'instance_factory' .* is <pagedllm_test_plugin\.backend\.TestEcho"):
            pm.attention_backends.load("instance_factory")
        with pytest.raises(PluginError, match=r"is <class '.*HalfModel'>, not a subclass of "
                                              r"pagedllm\.model_registry\.interface:ModelForCausalLM"):
            pm.models.load("HalfForCausalLM")
        # A plugin API 1.0 model (no ModelForCausalLM base, the four methods) still loads.
        assert pm.models.load("DuckForCausalLM") is DuckTypedModel
    finally:
        pm.unregister(name="wrong-base")


def test_builtin_models_implement_the_model_interface_and_duck_typed_models_pass() -> None:
    from pagedllm.model_registry.models.llama import LlamaForCausalLM

    pm = get_plugin_manager()
    for name in ["LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "GptOssForCausalLM",
                 "Phi3ForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM", "GraniteForCausalLM",
                 "Olmo2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM",
                 "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]:
        model_cls = pm.models.load(name)
        assert ModelForCausalLM in model_cls.__mro__, name  # explicitly, not by duck typing
    required = {"forward", "compute_logits", "load_weights", "get_attention_layers"}
    assert ModelForCausalLM.__abstractmethods__ == required
    assert LlamaForCausalLM.packed_modules_mapping["k_proj"] == ("qkv_proj", 1)
    assert ModelForCausalLM.packed_modules_mapping == {}  # the optional mapping's default
    assert issubclass(DuckTypedModel, ModelForCausalLM) and ModelForCausalLM not in DuckTypedModel.__mro__
    assert not issubclass(HalfModel, ModelForCausalLM)
    # The installed example package is a real 1.0 model of this kind, unchanged.
    gpt2 = pm.models.load("GPT2LMHeadModel")
    assert issubclass(gpt2, ModelForCausalLM) and ModelForCausalLM not in gpt2.__mro__
    assert not issubclass(type("NotAModule", (), dict(vars(DuckTypedModel))), ModelForCausalLM)
