"""The process-wide plugin manager: builtins, then entry points, each guarded.

Registries are collected lazily from the ``register_*`` hooks and dropped
whenever the set of plugins changes, so a plugin registered in a test fixture
is visible at once and gone after ``unregister``.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, overload

import pluggy
from pydantic import BaseModel

from pagedllm.core.errors import PluginError
from pagedllm.plugins import builtin, hookspecs
from pagedllm.plugins.compat import API_VERSION, ApiCompatibility, check_api_compatibility
from pagedllm.plugins.kinds import KIND_SPECS, KindSpec, PluginKind, kind_spec
from pagedllm.plugins.metadata import MetadataError, build_info
from pagedllm.plugins.plugin_config import (
    PLUGIN_CONFIG_ATTR,
    Declared,
    PluginConfigs,
    build_plugin_configs,
    check_declared_model,
)
from pagedllm.plugins.registry import BUILTIN_SOURCE, Registration, Registry, import_target

if TYPE_CHECKING:
    from pagedllm.attention_backends.base import AttentionBackend, AttentionCapabilities
    from pagedllm.executors.base import Executor
    from pagedllm.kv_connectors.base import KVConnectorBase
    from pagedllm.logits_processors.interface import LogitsProcessor
    from pagedllm.lora.resolver import LoRAResolver
    from pagedllm.model_registry.interface import ModelForCausalLM
    from pagedllm.model_registry.source import ModelSource
    from pagedllm.platforms.interface import Platform
    from pagedllm.plugins.metadata import (
        DrafterInfo,
        ExecutorInfo,
        GrammarBackendInfo,
        KVConnectorInfo,
        LogitsProcessorInfo,
        LoRAResolverInfo,
        ModelInfo,
        ModelSourceInfo,
        PlatformInfo,
        QuantizationInfo,
        ReasoningParserInfo,
        RouterInfo,
        SpecPolicyInfo,
        StatLoggerInfo,
        ToolParserInfo,
    )
    from pagedllm.quantization.base import QuantizationMethod
    from pagedllm.reasoning.interface import ReasoningParser
    from pagedllm.routers.base import RoutingPolicy
    from pagedllm.spec_decode.interface import Drafter
    from pagedllm.spec_decode.policy import SpeculationPolicy
    from pagedllm.stat_loggers.base import StatLoggerBase
    from pagedllm.structured_output.interface import GrammarBackend
    from pagedllm.tool_parsers.base import ToolParser

logger = logging.getLogger("pagedllm.plugins")

ENTRY_POINT_GROUP = "pagedllm.plugins"
BUILTIN_PLUGIN_NAME = "builtin"
TRACE_ENV = "PAGEDLLM_TRACE_PLUGINS"

# kind -> the hook that fills it (plugins/kinds.py has the whole spec)
KIND_HOOKS: dict[str, str] = {kind: spec.hook for kind, spec in KIND_SPECS.items()}
KINDS: tuple[PluginKind, ...] = tuple(KIND_SPECS)

OptionsT = TypeVar("OptionsT", bound=BaseModel)


@dataclass(frozen=True)
class PluginLoadError:
    """An entry point that could not be loaded; shown by ``pagedllm plugins list``."""

    plugin: str  # entry point name
    distribution: str  # "<distribution> <version>", or "unknown"
    error: str  # "ExceptionType: message"
    api_range: str | None = None  # the plugin's PAGEDLLM_API_VERSION when that was the reason


@dataclass(frozen=True)
class PluginInfo:
    name: str  # pluggy name (entry point name, "builtin", or the pm.register name)
    source: str
    # The plugin API range it declares (PAGEDLLM_API_VERSION); None = undeclared.
    api_range: str | None = None

    @property
    def distribution(self) -> str | None:
        """The distribution name when the plugin came from one ("pkg 1.0" -> "pkg")."""
        name, _, version = self.source.partition(" ")
        return name if version else None

    @property
    def version(self) -> str | None:
        return self.source.partition(" ")[2] or None


def _distribution_label(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "unknown"
    return f"{dist.name} {dist.version}"


class PluginManager:
    """Wraps a ``pluggy.PluginManager`` for project ``pagedllm``.

    Use :func:`get_plugin_manager` for the process-wide instance; build a
    private one only in tests that exercise entry-point loading.
    """

    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs)
        self._lock = threading.RLock()
        self._sources: dict[str, str] = {}  # pluggy name -> source label
        self._api_ranges: dict[str, str | None] = {}  # pluggy name -> declared API range
        self._entry_point_plugins: set[str] = set()
        self._load_errors: dict[str, PluginLoadError] = {}
        self._load_args: tuple[frozenset[str] | None, frozenset[str], bool] | None = None
        self._registries: dict[PluginKind, Registry[Any, Any]] = {}
        # kind -> registrations left out for invalid metadata, found when the kind is collected
        self._registration_errors: dict[PluginKind, list[PluginLoadError]] = {}
        # plugins.config as given, and each plugin's options validated from it
        # (None: to be rebuilt, after a plugin came or went)
        self._config_given: dict[str, Any] = {}
        self._plugin_configs: PluginConfigs | None = None
        if os.environ.get(TRACE_ENV, "") not in ("", "0"):
            self.enable_tracing()
        self._register(builtin, BUILTIN_PLUGIN_NAME, BUILTIN_SOURCE)

    # ---- loading -------------------------------------------------------

    def load(
        self,
        enabled: Iterable[str] | None = None,
        disabled: Iterable[str] = (),
        strict: bool = False,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        """Load the entry points of group ``pagedllm.plugins`` (builtins are always in).

        ``enabled``: plugin (entry point) names to load, None = all;
        ``disabled``: names never to load. Calling again with other lists
        loads or unloads the difference; with the same lists it does nothing.
        Each entry point is loaded inside its own guard: a failure is logged
        and recorded in :attr:`load_errors`, and raised as PluginError only
        when ``strict``.

        ``config``: ``plugins.config``, each plugin's options by plugin name,
        validated here against the models the plugins declare (a ConfigError
        names the plugin, the key, the value and what is allowed); None keeps
        the options given before.
        """
        args = (
            None if enabled is None else frozenset(enabled),
            frozenset(disabled),
            strict,
        )
        with self._lock:
            if config is not None:
                self._config_given = dict(config)
                self._plugin_configs = None
            if args == self._load_args:
                self._check_plugin_configs(strict)
                return
            self._load_args = args
            enabled_set, disabled_set, _ = args
            entry_points = self._entry_points()
            known = {ep.name for ep in entry_points} | {BUILTIN_PLUGIN_NAME}
            for name in sorted(((enabled_set or set()) | disabled_set) - known):
                logger.warning("plugin %r named in the plugin allow/deny list is not installed", name)

            wanted = [
                ep
                for ep in entry_points
                if (enabled_set is None or ep.name in enabled_set) and ep.name not in disabled_set
            ]
            wanted_names = {ep.name for ep in wanted}
            for name in sorted(self._entry_point_plugins - wanted_names):
                self._unregister_name(name)
                self._entry_point_plugins.discard(name)
            for name in list(self._load_errors):
                if name not in wanted_names:
                    del self._load_errors[name]
            for ep in wanted:
                if ep.name not in self._entry_point_plugins:
                    self._load_entry_point(ep)
            self._invalidate()
            if strict and self._load_errors:
                err = next(iter(self._load_errors.values()))
                raise PluginError(
                    f"plugin {err.plugin!r} ({err.distribution}) failed to load: {err.error}"
                    " (plugins.strict is set)"
                )
            if strict:
                for kind in KINDS:  # a registration with invalid metadata raises here
                    self.registry(kind)
            self._check_plugin_configs(strict)

    def _check_plugin_configs(self, strict: bool) -> None:
        # NOTE: every process validates the same options when it loads, before any use.
        self._configs()
        if strict and self._config_declaration_errors():
            raise PluginError(f"{self._config_declaration_errors()[0].error} (plugins.strict is set)")

    def _entry_points(self) -> list[importlib.metadata.EntryPoint]:
        """Entry points of our group, de-duplicated (a distribution can be found twice on sys.path)."""
        seen: set[tuple[str, str]] = set()
        unique = []
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            if (ep.name, ep.value) in seen:
                continue
            seen.add((ep.name, ep.value))
            unique.append(ep)
        # Sorted by name: registration order (and `plugins list`) must not
        # depend on the order site-packages happens to list distributions in.
        return sorted(unique, key=lambda ep: ep.name)

    def _load_entry_point(self, ep: importlib.metadata.EntryPoint) -> None:
        source = _distribution_label(ep)
        self._load_errors.pop(ep.name, None)
        try:
            plugin = ep.load()
            compat = check_api_compatibility(plugin)
            if not compat.compatible:
                error = PluginLoadError(
                    ep.name, source, f"IncompatiblePluginAPI: {compat.reason}; skipped", compat.declared
                )
                self._load_errors[ep.name] = error
                logger.error("skipped plugin %r from %s: %s", ep.name, source, error.error)
                return
            self._register(plugin, ep.name, source)
        except Exception as exc:  # NOTE: one broken plugin must not take down the others
            error = PluginLoadError(ep.name, source, f"{type(exc).__name__}: {exc}")
            self._load_errors[ep.name] = error
            logger.error("failed to load plugin %r from %s: %s", ep.name, source, error.error)
            return
        self._entry_point_plugins.add(ep.name)
        logger.debug("loaded plugin %r from %s", ep.name, source)

    def _ensure_loaded(self) -> None:
        if self._load_args is None:
            self.load()

    # ---- registering (tests, and the guarded entry-point path) ---------

    def register(self, plugin: object, name: str | None = None) -> str:
        """Register a plugin object/module directly (tests); returns its name.

        A plugin whose PAGEDLLM_API_VERSION excludes this API is a PluginError.
        """
        with self._lock:
            self._ensure_loaded()
            compat = check_api_compatibility(plugin)
            if not compat.compatible:
                raise PluginError(f"plugin {name or plugin!r} cannot be registered: {compat.reason}")
            return self._register(plugin, name, None)

    def _register(self, plugin: object, name: str | None, source: str | None) -> str:
        try:
            registered_name = self.pm.register(plugin, name=name)
        except ValueError as exc:  # pluggy: name or object already registered
            raise PluginError(f"plugin {name or plugin!r} is already registered: {exc}") from exc
        except pluggy.PluginValidationError as exc:
            raise PluginError(f"plugin {name or plugin!r} does not match the hookspecs: {exc}") from exc
        if registered_name is None:  # pluggy returns None for names blocked with pm.set_blocked
            raise PluginError(f"plugin {name!r} is blocked")
        unknown = [
            impl.function.__name__
            for caller in self.pm.get_hookcallers(plugin) or []
            if not caller.has_spec()
            for impl in caller.get_hookimpls()
            if impl.plugin is plugin and not impl.optionalhook
        ]
        if unknown:
            self.pm.unregister(plugin)
            raise PluginError(
                f"plugin {registered_name!r} implements unknown hooks {unknown}; "
                f"known hooks: {sorted(self._hook_names())}"
            )
        self._sources[registered_name] = source or registered_name
        self._api_ranges[registered_name] = check_api_compatibility(plugin).declared
        self._invalidate()
        return registered_name

    def unregister(self, plugin: object | None = None, name: str | None = None) -> None:
        with self._lock:
            if name is None:
                if plugin is None:
                    raise ValueError("unregister needs a plugin or a name")
                name = self.pm.get_name(plugin)
            if name == BUILTIN_PLUGIN_NAME:
                raise PluginError("the builtin plugin cannot be unregistered")
            if name is not None:
                self._unregister_name(name)
                self._entry_point_plugins.discard(name)

    def _unregister_name(self, name: str) -> None:
        if self.pm.get_plugin(name) is not None:
            self.pm.unregister(name=name)
        self._sources.pop(name, None)
        self._api_ranges.pop(name, None)
        self._invalidate()

    # ---- registries ----------------------------------------------------

    def registry(self, kind: str) -> Registry[Any, Any]:
        """The registry of one kind (a PluginKind or its string value),
        collected from the hooks on first use. The typed properties below
        (``models``, ``attention_backends``, ...) say what each one holds."""
        spec = kind_spec(kind)
        if spec is None:
            raise PluginError(f"unknown plugin kind {kind!r}; kinds: {', '.join(KINDS)}")
        with self._lock:
            self._ensure_loaded()
            registry = self._registries.get(spec.kind)
            if registry is None:
                registry = self._collect(spec)
                self._registries[spec.kind] = registry
            return registry

    @property
    def platforms(self) -> Registry[Platform, PlatformInfo]:
        return self.registry(PluginKind.PLATFORM)

    @property
    def attention_backends(self) -> Registry[AttentionBackend, AttentionCapabilities]:
        return self.registry(PluginKind.ATTENTION_BACKEND)

    @property
    def models(self) -> Registry[ModelForCausalLM, ModelInfo]:
        return self.registry(PluginKind.MODEL)

    @property
    def drafters(self) -> Registry[Drafter, DrafterInfo]:
        return self.registry(PluginKind.DRAFTER)

    @property
    def spec_policies(self) -> Registry[SpeculationPolicy, SpecPolicyInfo]:
        return self.registry(PluginKind.SPEC_POLICY)

    @property
    def grammar_backends(self) -> Registry[GrammarBackend, GrammarBackendInfo]:
        return self.registry(PluginKind.GRAMMAR_BACKEND)

    @property
    def kv_connectors(self) -> Registry[KVConnectorBase, KVConnectorInfo]:
        return self.registry(PluginKind.KV_CONNECTOR)

    @property
    def model_sources(self) -> Registry[ModelSource, ModelSourceInfo]:
        return self.registry(PluginKind.MODEL_SOURCE)

    @property
    def executors(self) -> Registry[Executor, ExecutorInfo]:
        return self.registry(PluginKind.EXECUTOR)

    @property
    def routers(self) -> Registry[RoutingPolicy, RouterInfo]:
        return self.registry(PluginKind.ROUTER)

    @property
    def quantization_methods(self) -> Registry[QuantizationMethod, QuantizationInfo]:
        return self.registry(PluginKind.QUANTIZATION_METHOD)

    @property
    def tool_parsers(self) -> Registry[ToolParser, ToolParserInfo]:
        return self.registry(PluginKind.TOOL_PARSER)

    @property
    def reasoning_parsers(self) -> Registry[ReasoningParser, ReasoningParserInfo]:
        return self.registry(PluginKind.REASONING_PARSER)

    @property
    def logits_processors(self) -> Registry[LogitsProcessor, LogitsProcessorInfo]:
        return self.registry(PluginKind.LOGITS_PROCESSOR)

    @property
    def stat_loggers(self) -> Registry[StatLoggerBase, StatLoggerInfo]:
        return self.registry(PluginKind.STAT_LOGGER)

    @property
    def lora_resolvers(self) -> Registry[LoRAResolver, LoRAResolverInfo]:
        return self.registry(PluginKind.LORA_RESOLVER)

    def _collect(self, spec: KindSpec) -> Registry[Any, Any]:
        registry: Registry[Any, Any] = Registry(spec.kind, spec.interface)
        self._registration_errors[spec.kind] = []
        caller = getattr(self.pm.hook, spec.hook)
        plugins = []
        for impl in caller.get_hookimpls():  # registration order: builtin first
            if impl.plugin not in plugins:
                plugins.append(impl.plugin)
        for plugin in plugins:
            plugin_name = self.pm.get_name(plugin)
            assert plugin_name is not None
            # One call per plugin so that each registration knows its source;
            # subset_hook_caller keeps the call inside pluggy (and its tracing).
            only_this = self.pm.subset_hook_caller(spec.hook, [p for p in plugins if p is not plugin])
            only_this(register=self._make_register(spec, plugin_name, registry))
        return registry

    def _make_register(self, spec: KindSpec, plugin_name: str, registry: Registry[Any, Any]) -> hookspecs.RegisterFn:
        kind, source = spec.kind, self._sources.get(plugin_name, plugin_name)
        info_cls = import_target(spec.info)

        def register(name: str, target: hookspecs.Target, /, **metadata: Any) -> None:
            if not isinstance(name, str) or not name:
                raise PluginError(f"{source} registered a {kind} with an invalid name {name!r}")
            if not (isinstance(target, str) and ":" in target) and not callable(target):
                raise PluginError(
                    f"{source} registered {kind} {name!r} with target {target!r}; "
                    "expected 'package.module:Attr' or a callable"
                )

            def warn(message: str) -> None:  # an unknown key of a free-form kind
                logger.warning("%s registered %s %r: %s", source, kind, name, message)

            # Old names that still select this registration (a renamed component).
            aliases = metadata.pop("aliases", None) or []
            try:
                if isinstance(aliases, str) or not all(isinstance(alias, str) and alias for alias in aliases):
                    raise MetadataError(f"metadata aliases={aliases!r} is invalid: a list of names")
                info = build_info(info_cls, metadata, warn)
            except MetadataError as exc:
                self._reject_registration(kind, plugin_name, source, f"{source} registered {kind} {name!r}: {exc}")
                return
            registry.add(Registration(kind, name, target, source, dict(metadata), info=info, plugin=plugin_name))
            for alias in aliases:
                registry.add_alias(alias, name, source)

        return register

    def _reject_registration(self, kind: PluginKind, plugin_name: str, source: str, message: str) -> None:
        """A registration with invalid metadata: left out and reported like a
        plugin that failed to load (an error in strict mode), so it never
        takes down the plugin's other registrations or any other plugin."""
        if self._load_args is not None and self._load_args[2]:
            raise PluginError(f"{message} (plugins.strict is set)")
        logger.error("skipped a registration of plugin %r: %s", plugin_name, message)
        self._registration_errors[kind].append(PluginLoadError(plugin_name, source, f"PluginError: {message}"))

    def _invalidate(self) -> None:
        self._registries = {}
        self._registration_errors = {}
        self._plugin_configs = None

    # ---- per-plugin options (plugins/plugin_config.py) ------------------

    def _configs(self) -> PluginConfigs:
        with self._lock:
            if self._plugin_configs is None:
                declared = {name: self._declared_config_model(plugin) for name, plugin in self.pm.list_name_plugin()}
                inactive = [ep.name for ep in self._entry_points()] if self._config_given else []
                self._plugin_configs = build_plugin_configs(declared, self._config_given, inactive)
            return self._plugin_configs

    def _declared_config_model(self, plugin: object) -> Declared:
        others = [p for _, p in self.pm.list_name_plugin() if p is not plugin]
        declared: list[object] = [getattr(plugin, PLUGIN_CONFIG_ATTR, None)]
        self.pm.subset_hook_caller("register_plugin_config", others)(register=declared.append)
        return check_declared_model(self.pm.get_name(plugin) or repr(plugin), declared)

    @overload
    def plugin_config(self, plugin: type[OptionsT]) -> OptionsT: ...

    @overload
    def plugin_config(self, plugin: str) -> BaseModel | None: ...

    def plugin_config(self, plugin: str | type[BaseModel]) -> BaseModel | None:
        """A plugin's validated options. A component passes its own config
        model (``plugin_config(MyOptions)``: the options of the plugin that
        declared it, whatever name it was installed under); by plugin name,
        None for a plugin that declares no model."""
        with self._lock:
            self._ensure_loaded()
            configs = self._configs()
            if isinstance(plugin, str):
                if self.pm.get_plugin(plugin) is None:
                    raise PluginError(f"no plugin named {plugin!r} is registered")
                return configs.get(plugin)
            owners = [name for name, model in configs.models.items() if model is plugin]
            if len(owners) != 1:
                found = f"plugins {owners} all declare it" if owners else "no registered plugin declares it"
                raise PluginError(f"config model {plugin.__qualname__}: {found}; ask by plugin name")
            return configs.get(owners[0])  # NOTE: raises the error of options that do not validate

    def plugin_config_model(self, name: str) -> type[BaseModel] | None:
        """The config model plugin ``name`` declares (None: it declares none)."""
        with self._lock:
            self._ensure_loaded()
            return self._configs().models.get(name)

    def component_config(self, kind: str, name: str) -> BaseModel | None:
        """The options of the plugin that registered component ``name`` of ``kind``."""
        registration = self.registry(kind).get(name)
        return None if registration.plugin is None else self.plugin_config(registration.plugin)

    # ---- introspection -------------------------------------------------

    @property
    def hook(self) -> Any:
        """``pm.hook.on_engine_start(config=...)`` and friends."""
        self._ensure_loaded()
        return self.pm.hook

    @property
    def load_errors(self) -> list[PluginLoadError]:
        """Entry points that failed to load, then registrations left out for
        invalid metadata (every kind is collected to find those), then
        plugins whose config model declaration is invalid."""
        with self._lock:
            self._ensure_loaded()
            for kind in KINDS:
                self.registry(kind)
            rejected = [error for kind in KINDS for error in self._registration_errors.get(kind, [])]
            return [*self._load_errors.values(), *rejected, *self._config_declaration_errors()]

    def _config_declaration_errors(self) -> list[PluginLoadError]:
        return [
            PluginLoadError(name, self._sources.get(name, name), f"PluginError: {error}")
            for name, error in self._configs().errors.items()
            if isinstance(error, PluginError)
        ]

    def plugins(self) -> list[PluginInfo]:
        self._ensure_loaded()
        return [
            PluginInfo(name, self._sources.get(name, name), self._api_ranges.get(name))
            for name, _ in self.pm.list_name_plugin()
        ]

    def api_compatibility(self, name: str) -> ApiCompatibility:
        """A registered plugin's declared API range checked against API_VERSION."""
        plugin = self.pm.get_plugin(name)
        if plugin is None:
            raise PluginError(f"no plugin named {name!r} is registered")
        return check_api_compatibility(plugin, API_VERSION)

    def source_of(self, name: str) -> str | None:
        return self._sources.get(name)

    def _hook_names(self) -> Sequence[str]:
        return [name for name in vars(hookspecs) if getattr(getattr(hookspecs, name), "pagedllm_spec", None)]

    def enable_tracing(self) -> None:
        """Log every hook call and its result (``PAGEDLLM_TRACE_PLUGINS=1``).

        The records are INFO on logger ``pagedllm.plugins``, which is lowered
        to INFO here so that a trace asked for is a trace shown, whatever the
        log level of the rest of pagedllm.
        """
        if not logger.isEnabledFor(logging.INFO):
            logger.setLevel(logging.INFO)

        def before(hook_name: str, hook_impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, Any]) -> None:
            logger.info(
                "hook %s(%s) -> %s",
                hook_name,
                ", ".join(f"{k}={v!r}" for k, v in kwargs.items()),
                [impl.plugin_name for impl in hook_impls],
            )

        def after(
            outcome: pluggy.Result[Any],
            hook_name: str,
            hook_impls: Sequence[pluggy.HookImpl],
            kwargs: Mapping[str, Any],
        ) -> None:
            exc = outcome.exception
            logger.info("hook %s returned %s", hook_name, f"error {exc!r}" if exc else repr(outcome.get_result()))

        self.pm.add_hookcall_monitoring(before, after)


_manager: PluginManager | None = None
_manager_lock = threading.Lock()


def get_plugin_manager() -> PluginManager:
    """The process-wide manager. Builtins are in; entry points load on first use
    (or on the first explicit ``load(enabled=..., disabled=..., strict=...)``)."""
    global _manager
    if _manager is None:
        with _manager_lock:
            if _manager is None:
                _manager = PluginManager()
    return _manager
