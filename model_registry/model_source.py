"""Model names to folders, through the registered model sources.

`model.model`, `model.tokenizer` and `speculative.model` may name a folder, a
hub id, or a name a model source knows (plugin kind `model_source`,
model_registry/interface.py). The built-in source `tiny` knows the shipped
models; a plugin may add its own (a model zoo, a company's model store).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.plugins import get_plugin_manager

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
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


def resolve_hub_models(config: EngineConfig, plugin_manager: PluginManager | None = None) -> EngineConfig:
    """`config` with each hub id (model, tokenizer, speculative model)
    replaced by its downloaded snapshot folder; the same config when there
    is none. Called once, in the process that starts the engine, so ranks in
    other processes only ever see folders and never download.

    The served model name stays the hub id as written (vLLM's), not the
    snapshot folder's name (a commit hash)."""
    model = config.model
    model_name = model.model
    if model_name is None or not _is_hub_id(model_name, plugin_manager):
        model_folder = None
    else:
        model_folder = _download(model_name, model.revision, config, tokenizer_only=False)
    tokenizer_folder = _tokenizer_folder(config, model_folder, plugin_manager)
    draft_folder = _draft_folder(config, plugin_manager)
    if model_folder is None and tokenizer_folder is None and draft_folder is None:
        return config
    update: dict[str, Any] = {}
    if model_folder is not None:
        update["model"] = model.model_copy(update={"model": model_folder})
        if config.server.served_model_name is None:
            update["server"] = config.server.model_copy(update={"served_model_name": model_name})
    if tokenizer_folder is not None:
        update["model"] = update.get("model", model).model_copy(update={"tokenizer": tokenizer_folder})
    if draft_folder is not None:
        update["speculative"] = config.speculative.model_copy(update={"model": draft_folder})
    return config.model_copy(update=update)


def _is_hub_id(name: str, plugin_manager: PluginManager | None) -> bool:
    """No model source knows it, and it is no local path."""
    from pagedllm.model_registry.hub import looks_like_hub_id

    return looks_like_hub_id(name) and find_model(name, plugin_manager) is None


def _download(repo_id: str, revision: str | None, config: EngineConfig, *, tokenizer_only: bool) -> str:
    from pagedllm.model_registry.hub import download_snapshot

    model = config.model
    return download_snapshot(repo_id, revision, model.download_dir, model.load_format, tokenizer_only=tokenizer_only)


def _tokenizer_folder(
    config: EngineConfig, model_folder: str | None, plugin_manager: PluginManager | None
) -> str | None:
    """The tokenizer's snapshot folder when it comes from the hub: the
    model's own snapshot when it is the model's repo at the same revision."""
    model = config.model
    same_repo = model.tokenizer in (None, model.model)
    revision = model.tokenizer_revision or (model.revision if same_repo else None)
    if same_repo and revision == model.revision:
        return model_folder if model.tokenizer is not None else None
    name = model.tokenizer or model.model
    if name is None or not _is_hub_id(name, plugin_manager):
        return None
    return _download(name, revision, config, tokenizer_only=True)


def _draft_folder(config: EngineConfig, plugin_manager: PluginManager | None) -> str | None:
    name = config.speculative.model
    if config.speculative.method is None or name is None or not _is_hub_id(name, plugin_manager):
        return None
    return _download(name, None, config, tokenizer_only=False)


def resolve_config_folder(name: str, plugin_manager: PluginManager | None = None) -> str:
    """A folder with `name`'s config.json, as `resolve_model_path`; a hub id
    downloads its configs and tokenizer only (no weights: `pagedllm env`)."""
    if not _is_hub_id(name, plugin_manager):
        return resolve_model_path(name, plugin_manager)
    from pagedllm.model_registry.hub import download_snapshot

    return download_snapshot(name, None, None, "dummy")


def model_display_name(resolved_path: str) -> str:
    """The name a served model goes by: its folder's name, a GGUF file's
    stem (`Llama-3-8B.Q4_K_M.gguf` serves as `Llama-3-8B.Q4_K_M`)."""
    path = Path(resolved_path)
    return path.stem if path.suffix == ".gguf" else path.name
