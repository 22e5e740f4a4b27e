"""Per-plugin configuration: a plugin's own options, declared as a pydantic
model, set by the user under ``plugins.config.<plugin name>``, and validated
when the plugins load.

A plugin declares its model in one of two ways (both in docs/plugins.md)::

    PAGEDLLM_PLUGIN_CONFIG = MyOptions            # module attribute

    @hookimpl
    def register_plugin_config(register):        # or the hook
        register(MyOptions)

Users set the options in the config file (``plugins: {config: {name: {...}}}``),
by environment (``PAGEDLLM_PLUGINS__CONFIG__<NAME>__<KEY>``), by flag
(``--plugin-config NAME='{"key": 1}'``) or ``LLM(plugin_config={...})``; they
travel inside the EngineConfig, so every process (the engine core, each
worker rank) validates the same values into the same options. A component
reads its own plugin's options with
``get_plugin_manager().plugin_config(MyOptions)``.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource

from pagedllm.core.config import config_error_from_validation
from pagedllm.core.errors import ConfigError, PagedLLMError, PluginError

logger = logging.getLogger("pagedllm.plugins")

# The module attribute a plugin may declare its config model in.
PLUGIN_CONFIG_ATTR = "PAGEDLLM_PLUGIN_CONFIG"
CONFIG_KEY = "plugins.config"

# A plugin's declared model: the class, None (declares none), or why the
# declaration itself is wrong (raised when its options are given or read).
Declared = type[BaseModel] | PluginError | None


def model_label(model: type[BaseModel]) -> str:
    return f"{model.__module__}:{model.__qualname__}"


def check_declared_model(plugin_name: str, declared: Iterable[object]) -> Declared:
    """The one config model a plugin declares (module attribute and hook
    together), or the PluginError saying why its declaration is invalid."""
    models: list[object] = []
    for model in declared:
        if model is not None and not any(model is seen for seen in models):
            models.append(model)
    if not models:
        return None
    if len(models) > 1:
        return PluginError(f"plugin {plugin_name!r} declares more than one config model: {models!r}")
    model = models[0]
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return PluginError(f"plugin {plugin_name!r} declares config model {model!r}, not a pydantic BaseModel subclass")
    return model


def normalized(name: str) -> str:
    """How a configured name matches a plugin: env var names arrive lowercased
    and cannot hold a dash, so case and ``-``/``_`` do not count."""
    return name.lower().replace("-", "_")


@dataclass
class PluginConfigs:
    """Every registered plugin's config model and validated options."""

    models: dict[str, type[BaseModel]] = field(default_factory=dict)
    options: dict[str, BaseModel] = field(default_factory=dict)
    # plugin -> the error its options gave, raised when they are read
    # (defaults a model cannot build alone, an invalid declaration).
    errors: dict[str, PagedLLMError] = field(default_factory=dict)

    def get(self, plugin_name: str) -> BaseModel | None:
        error = self.errors.get(plugin_name)
        if error is not None:
            raise error
        return self.options.get(plugin_name)


def build_plugin_configs(
    declared: Mapping[str, Declared], given: Mapping[str, Any], inactive: Iterable[str] = ()
) -> PluginConfigs:
    """Validate ``given`` (``plugins.config``) against each registered
    plugin's declared model (``declared``, in registration order).

    Options for a plugin that is installed but not loaded (``inactive``:
    disabled, or failed to load, which is reported on its own) are ignored
    with a warning; for any other unknown name, or for a plugin that declares
    no options, they are a ConfigError.
    """
    by_plugin = _resolve_names(list(declared), given, list(inactive))
    configs = PluginConfigs()
    for plugin_name, model in declared.items():
        values = by_plugin.get(plugin_name)
        if isinstance(model, PluginError):
            if values is not None:
                raise model
            configs.errors[plugin_name] = model
            continue
        if model is None:
            if values:
                allowed = f"no options: plugin {plugin_name!r} declares no config model"
                raise ConfigError(f"{CONFIG_KEY}.{plugin_name}", values, allowed)
            continue
        configs.models[plugin_name] = model
        try:
            configs.options[plugin_name] = validate_options(plugin_name, model, values or {})
        except ConfigError as exc:
            if values is not None:
                raise
            configs.errors[plugin_name] = exc  # e.g. a required option nobody set: only its users fail
    return configs


def _resolve_names(plugin_names: list[str], given: Mapping[str, Any], inactive: list[str]) -> dict[str, Any]:
    exact = set(plugin_names)
    loose = {normalized(name): name for name in plugin_names}
    inactive_loose = {normalized(name) for name in inactive}
    by_plugin: dict[str, Any] = {}
    for name, values in given.items():
        plugin_name = name if name in exact else loose.get(normalized(name))
        if plugin_name is not None:
            by_plugin[plugin_name] = _merge(by_plugin.get(plugin_name), values)
        elif normalized(name) in inactive_loose:
            logger.warning("options for plugin %r ignored: it is installed but not loaded", name)
        else:
            known = ", ".join(sorted(exact)) or "(none)"
            raise ConfigError(f"{CONFIG_KEY}.{name}", values, f"options of a loaded plugin; loaded plugins: {known}")
    return by_plugin


def _merge(old: Any, new: Any) -> Any:
    # `my-plugin` from a file and MY_PLUGIN from env name the same plugin.
    if isinstance(old, Mapping) and isinstance(new, Mapping):
        return {**old, **new}
    return new


def validate_options(plugin_name: str, model: type[BaseModel], values: Any) -> BaseModel:
    """``model`` built from ``values``; a ConfigError names
    ``plugins.config.<plugin>.<key>``, the value and what is allowed."""
    prefix = f"{CONFIG_KEY}.{plugin_name}"
    if not isinstance(values, Mapping):
        raise ConfigError(prefix, values, "a mapping of option name -> value")
    known = _known_keys(model)
    for key, value in values.items():
        if key not in known:  # NOTE: whatever the model's own `extra`: a misspelt option fails loudly
            raise ConfigError(f"{prefix}.{key}", value, f"an option of plugin {plugin_name!r}: {', '.join(known)}")
    try:
        return _validate(model, _decode_env_strings(model, values))
    except ValidationError as exc:
        raise config_error_from_validation(model, exc, prefix=f"{prefix}.") from None


def _validate(model: type[BaseModel], values: dict[str, Any]) -> BaseModel:
    if not issubclass(model, BaseSettings):
        return model.model_validate(values)
    # NOTE: a settings model validates in its __init__, which would also read
    # the environment (and .env files) of whichever process builds it: a Ray
    # worker on another host could then see other options. Only `values`
    # count (the user's env is already in them, as plugins.config).
    validated = _init_values_only(model).model_validate(values)
    return model.model_construct(_fields_set=validated.model_fields_set, **dict(validated))


@functools.cache
def _init_values_only(model: type[BaseSettings]) -> type[BaseSettings]:
    def sources(cls: type[BaseSettings], /, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                **others: PydanticBaseSettingsSource) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)

    return type(model.__name__, (model,), {"settings_customise_sources": classmethod(sources)})


def _known_keys(model: type[BaseModel]) -> list[str]:
    keys = []
    for name, info in model.model_fields.items():
        keys.append(name)
        if isinstance(info.alias, str) and info.alias != name:
            keys.append(info.alias)
    return keys


def _decode_env_strings(model: type[BaseModel], values: Mapping[str, Any]) -> dict[str, Any]:
    """Env values are strings: a list or mapping option arrives as JSON text
    (``PAGEDLLM_PLUGINS__CONFIG__P__TIERS='[1, 2]'``); scalars are left to
    pydantic's lax parsing ("3" -> 3, "true" -> True)."""
    decoded = dict(values)
    for key, value in values.items():
        info = model.model_fields.get(key)
        if not isinstance(value, str) or info is None or info.annotation is str:
            continue
        if value.lstrip()[:1] in ("[", "{"):
            # Not JSON: left as given, and pydantic names the key and the value.
            with contextlib.suppress(json.JSONDecodeError):
                decoded[key] = json.loads(value)
    return decoded


def options_as_json(options: BaseModel | None) -> dict[str, Any] | None:
    """The effective options as plain JSON types (``pagedllm plugins list``)."""
    return None if options is None else options.model_dump(mode="json")


__all__ = [
    "PLUGIN_CONFIG_ATTR",
    "PluginConfigs",
    "build_plugin_configs",
    "check_declared_model",
    "model_label",
    "normalized",
    "options_as_json",
    "validate_options",
]
