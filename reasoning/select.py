"""The configured reasoning parser, looked up by name in the plugin registry
(the API server and the engine core's structured output both build one)."""

from __future__ import annotations

from typing import Any

from pagedllm.core.errors import ConfigError
from pagedllm.reasoning.interface import ReasoningParser

CONFIG_KEY = "structured_output.reasoning_parser"


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The registered ReasoningParser class `name`; a ConfigError naming the
    registered ones if there is none."""
    from pagedllm.plugins import get_plugin_manager

    registry = get_plugin_manager().reasoning_parsers
    if name not in registry:
        raise ConfigError(CONFIG_KEY, name, "a registered reasoning parser: " + ", ".join(sorted(registry.names())))
    return registry.load(name)


def build_reasoning_parser(name: str | None, tokenizer: Any) -> ReasoningParser | None:
    """`name`'s parser over `tokenizer`; None when no parser is configured."""
    if name is None:
        return None
    return reasoning_parser_class(name)(tokenizer)


__all__ = ["CONFIG_KEY", "build_reasoning_parser", "reasoning_parser_class"]
