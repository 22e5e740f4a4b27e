"""Starting the engine core of an AsyncLLM: the first thing `pagedllm serve`
does, before it imports its HTTP stack.

The core's process spends seconds importing torch and loading the model; the
API process meanwhile imports fastapi and uvicorn and loads the tokenizer, on
another core. So this module imports only what starting the core needs (the
ZMQ clients, the plugins, the model sources).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.engine.core_client import AsyncMPClient
from pagedllm.model_registry.generation_config import generation_sampling_defaults
from pagedllm.model_registry.model_source import resolve_model_path
from pagedllm.plugins import get_plugin_manager

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.engine.dp_client import DPAsyncMPClient


def start_async_engine_core(config: EngineConfig, *, in_process: bool = False) -> AsyncMPClient | DPAsyncMPClient:
    """The client of a started engine core (one per data-parallel replica);
    `wait_for_ready()` on it blocks until the core has loaded its model."""
    # Plugins load in this process too (the core loads its own): a plugin
    # that fails in strict mode fails here first, and API-side plugin code
    # (tokenizers, hooks) is available to the front end.
    get_plugin_manager().load(
        enabled=config.plugins.enabled,
        disabled=config.plugins.disabled,
        strict=config.plugins.strict,
        config=config.plugins.config,
    )
    # Built here (not raced by the core) when it is the embedded default.
    model_folder = resolve_model_path(config.model.model)
    generation_sampling_defaults(model_folder, config.model)  # a bad value fails before the core starts
    if config.parallel.data_parallel_size > 1:
        from pagedllm.engine.dp_client import DPAsyncMPClient

        return DPAsyncMPClient(config, in_thread=in_process)
    return AsyncMPClient(config, in_thread=in_process)
