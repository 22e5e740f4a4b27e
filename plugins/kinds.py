"""The plugin kinds: one constant each, and what the platform knows about them.

A kind is filled by one ``register_*`` hook. Its registrations' targets must
be subclasses of the kind's interface class (checked once, when a target is
first loaded), and its ``register`` keywords build the kind's metadata type
(checked when ``register`` is called). Both are named as lazy
``"module:Attr"`` strings, so that listing plugins imports no implementation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PluginKind(enum.StrEnum):
    """A plugin kind. A str: ``PluginKind.MODEL == "model"``, so code that
    passes the 1.0 string literals keeps working."""

    PLATFORM = "platform"
    ATTENTION_BACKEND = "attention_backend"
    MODEL = "model"
    DRAFTER = "drafter"
    SPEC_POLICY = "spec_policy"
    GRAMMAR_BACKEND = "grammar_backend"
    KV_CONNECTOR = "kv_connector"
    MODEL_SOURCE = "model_source"
    EXECUTOR = "executor"
    ROUTER = "router"
    QUANTIZATION_METHOD = "quantization_method"
    TOOL_PARSER = "tool_parser"
    REASONING_PARSER = "reasoning_parser"
    LOGITS_PROCESSOR = "logits_processor"
    STAT_LOGGER = "stat_logger"
    LORA_RESOLVER = "lora_resolver"


@dataclass(frozen=True)
class KindSpec:
    kind: PluginKind
    hook: str  # the register_* hook that fills the kind
    interface: str  # "module:Class" every target must subclass
    info: str  # "module:Dataclass" the register keywords build


_METADATA = "pagedllm.plugins.metadata"

KIND_SPECS: dict[PluginKind, KindSpec] = {
    spec.kind: spec
    for spec in (
        KindSpec(
            PluginKind.PLATFORM,
            "register_platforms",
            "pagedllm.platforms.interface:Platform",
            f"{_METADATA}:PlatformInfo",
        ),
        KindSpec(
            PluginKind.ATTENTION_BACKEND,
            "register_attention_backends",
            "pagedllm.attention_backends.base:AttentionBackend",
            "pagedllm.attention_backends.base:AttentionCapabilities",
        ),
        KindSpec(
            PluginKind.MODEL,
            "register_models",
            "pagedllm.model_registry.interface:ModelForCausalLM",
            f"{_METADATA}:ModelInfo",
        ),
        KindSpec(
            PluginKind.DRAFTER,
            "register_drafters",
            "pagedllm.spec_decode.interface:Drafter",
            f"{_METADATA}:DrafterInfo",
        ),
        KindSpec(
            PluginKind.SPEC_POLICY,
            "register_spec_policies",
            "pagedllm.spec_decode.policy:SpeculationPolicy",
            f"{_METADATA}:SpecPolicyInfo",
        ),
        KindSpec(
            PluginKind.GRAMMAR_BACKEND,
            "register_grammar_backends",
            "pagedllm.structured_output.interface:GrammarBackend",
            f"{_METADATA}:GrammarBackendInfo",
        ),
        KindSpec(
            PluginKind.KV_CONNECTOR,
            "register_kv_connectors",
            "pagedllm.kv_connectors.base:KVConnectorBase",
            f"{_METADATA}:KVConnectorInfo",
        ),
        KindSpec(
            PluginKind.MODEL_SOURCE,
            "register_model_sources",
            "pagedllm.model_registry.source:ModelSource",
            f"{_METADATA}:ModelSourceInfo",
        ),
        KindSpec(
            PluginKind.EXECUTOR,
            "register_executors",
            "pagedllm.executors.base:Executor",
            f"{_METADATA}:ExecutorInfo",
        ),
        KindSpec(
            PluginKind.ROUTER,
            "register_routers",
            "pagedllm.routers.base:RoutingPolicy",
            f"{_METADATA}:RouterInfo",
        ),
        KindSpec(
            PluginKind.QUANTIZATION_METHOD,
            "register_quantization_methods",
            "pagedllm.quantization.base:QuantizationMethod",
            f"{_METADATA}:QuantizationInfo",
        ),
        KindSpec(
            PluginKind.TOOL_PARSER,
            "register_tool_parsers",
            "pagedllm.tool_parsers.base:ToolParser",
            f"{_METADATA}:ToolParserInfo",
        ),
        KindSpec(
            PluginKind.REASONING_PARSER,
            "register_reasoning_parsers",
            "pagedllm.reasoning.interface:ReasoningParser",
            f"{_METADATA}:ReasoningParserInfo",
        ),
        KindSpec(
            PluginKind.LOGITS_PROCESSOR,
            "register_logits_processors",
            "pagedllm.logits_processors.interface:LogitsProcessor",
            f"{_METADATA}:LogitsProcessorInfo",
        ),
        KindSpec(
            PluginKind.STAT_LOGGER,
            "register_stat_loggers",
            "pagedllm.stat_loggers.base:StatLoggerBase",
            f"{_METADATA}:StatLoggerInfo",
        ),
        KindSpec(
            PluginKind.LORA_RESOLVER,
            "register_lora_resolvers",
            "pagedllm.lora.resolver:LoRAResolver",
            f"{_METADATA}:LoRAResolverInfo",
        ),
    )
}


def kind_spec(kind: str) -> KindSpec | None:
    """The spec of ``kind`` (a PluginKind or its string value); None if unknown."""
    try:
        return KIND_SPECS[PluginKind(kind)]
    except ValueError:
        return None


__all__ = ["KIND_SPECS", "KindSpec", "PluginKind", "kind_spec"]
