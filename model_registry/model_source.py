"""Model names to folders, through the registered model sources.

`model.model`, `model.tokenizer` and `speculative.model` may name a folder, a
hub id, or a name a model source knows (plugin kind `model_source`,
model_registry/interface.py). The built-in source `tiny` knows the shipped
models; a plugin may add its own (a model zoo, a company's model store).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from pagedllm.core.errors import ConfigError
from pagedllm.plugins import get_plugin_manager

if TYPE_CHECKING:
    from pagedllm.plugins.manager import PluginManager

# The model when none is configured: a name for the model sources (the
# built-in source `tiny` resolves it to the shipped pagedllm-tiny).
DEFAULT_MODEL = "tiny"


def resolve_model_path(
    name_or_path: str | os.PathLike[str] | None, plugin_manager: PluginManager | None = None
) -> str:
    """The first registered source's answer for a name, else the name itself
    (a folder or hub id for the loader); None is DEFAULT_MODEL.

    NOTE: a source's name wins over a same-named folder in the working
    directory, so `tiny` means the same model wherever the command runs.
    """
    if name_or_path is None:
        resolved = find_model(DEFAULT_MODEL, plugin_manager)
        if resolved is None:
            raise ConfigError(
                "model.model", None, f"a model folder or hub id (no model source knows the default {DEFAULT_MODEL!r})"
            )
        return resolved
    if isinstance(name_or_path, str):
        resolved = find_model(name_or_path, plugin_manager)
        if resolved is not None:
            return resolved
    return os.fspath(name_or_path)


def find_model(name: str, plugin_manager: PluginManager | None = None) -> str | None:
    """What the first model source that knows `name` resolves it to."""
    registry = (plugin_manager or get_plugin_manager()).model_sources
    for registration in registry.registrations():  # registration order: builtin first
        resolved = registry.load(registration.name)().resolve(name)
        if resolved is not None:
            return resolved
    return None
