"""Registration metadata as typed values.

``register(name, target, **metadata)`` keeps its free keyword form (plugin API
1.0), but each kind turns the keywords into one frozen dataclass when
``register`` is called: an unknown or misspelt key, or a value of the wrong
type, is a :class:`MetadataError` there, instead of a limit that silently
never applies. A field says how its value is read with :func:`parsed`; the
attention backend's :class:`~pagedllm.attention_backends.base.AttentionCapabilities`
is built the same way.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

InfoT = TypeVar("InfoT", bound="DataclassInstance")
Parser = Callable[[object], object]

_PARSE = "pagedllm_parse"
_FREE_FORM = "pagedllm_free_form"


class MetadataError(ValueError):
    """A ``register`` keyword that the kind does not accept, or a wrong value.

    The plugin manager wraps it in a PluginError that names the plugin.
    """


def parsed(parse: Parser, default: object = None) -> Any:
    """A dataclass field whose ``register`` value goes through ``parse``.

    Returns ``Any`` like :func:`dataclasses.field`, so the field's annotation
    stays the declared type.
    """
    return dataclasses.field(default=default, metadata={_PARSE: parse})


def free_form() -> Any:
    """The field that keeps the keys a kind does not read, for a kind whose
    metadata plugin API 1.0 documented as free-form: those keys are a warning
    (``build_info``'s ``warn``), not an error."""
    return dataclasses.field(default_factory=dict, metadata={_FREE_FORM: True})


def build_info(
    info_cls: type[InfoT], metadata: Mapping[str, object], warn: Callable[[str], None] | None = None
) -> InfoT:
    """``info_cls(**metadata)`` with every value parsed and every key known
    (or, for a free-form kind, kept aside and passed to ``warn``)."""
    fields = {f.name: f for f in dataclasses.fields(info_cls) if not f.metadata.get(_FREE_FORM)}
    free_form_field = next((f.name for f in dataclasses.fields(info_cls) if f.metadata.get(_FREE_FORM)), None)
    values: dict[str, object] = {}
    extra: dict[str, object] = {}
    for key, value in metadata.items():
        field = fields.get(key)
        if field is None:
            close = difflib.get_close_matches(key, list(fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            message = f"unknown metadata key {key!r}{hint}; accepted keys: {', '.join(fields) or 'none'}"
            if free_form_field is None:
                raise MetadataError(message)
            if warn is not None:
                warn(f"{message}; kept as free-form metadata (plugin API 1.0)")
            extra[key] = value
            continue
        if value is None:  # None is "not given": the field's default
            continue
        parse: Parser | None = field.metadata.get(_PARSE)
        try:
            values[key] = value if parse is None else parse(value)
        except (TypeError, ValueError) as exc:
            raise MetadataError(f"metadata {key}={value!r} is invalid: {exc}") from None
    if free_form_field is not None:
        values[free_form_field] = extra
    return info_cls(**values)


# ---- parsers: each takes the value as given, returns it normalised ----------


def flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected True or False, got {type(value).__name__}")
    return value


def count(value: object) -> int:
    """A positive int (a size, a multiple)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError("expected a positive int")
    return value


def names(value: object) -> tuple[str, ...]:
    """A list (or tuple) of strings; one bare string is refused, since
    ``"cuda"`` would otherwise read as the names "c", "u", "d", "a"."""
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(f"expected a list of strings, got {type(value).__name__}")
    if not all(isinstance(item, str) for item in value):
        raise TypeError("expected a list of strings")
    return tuple(value)


def counts(value: object) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise TypeError(f"expected a list of positive ints, got {type(value).__name__}")
    return tuple(count(item) for item in value)


def capability(value: object) -> tuple[int, int]:
    """A compute capability ``(major, minor)``."""
    if (
        not isinstance(value, (list, tuple))
        or len(value) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)
    ):
        raise TypeError("expected (major, minor), two ints")
    return (value[0], value[1])


def dtype_names(value: object) -> tuple[str, ...]:
    """Dtype names ("float16"); a ``torch.dtype`` is read as its name."""
    if isinstance(value, (list, tuple, set, frozenset)):
        value = [str(d).removeprefix("torch.") if type(d).__qualname__ == "dtype" else d for d in value]
    return names(value)


def dtype_capabilities(value: object) -> tuple[tuple[str, tuple[int, int]], ...]:
    """A mapping of dtype name (or ``torch.dtype``) -> compute capability,
    kept as sorted (name, (major, minor)) pairs (hashable, frozen)."""
    if not isinstance(value, Mapping):
        raise TypeError(f"expected a mapping of dtype -> (major, minor), got {type(value).__name__}")
    return tuple(sorted((dtype_names([key])[0], capability(cap)) for key, cap in value.items()))


def name(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise TypeError("expected a non-empty string")
    return value


# ---- the metadata of the kinds other than attention backends ----------------


@dataclass(frozen=True)
class PlatformInfo:
    """``register_platforms`` metadata."""

    device_type: str | None = parsed(name)  # "cpu", "cuda", ...: informational


@dataclass(frozen=True)
class ModelInfo:
    """``register_models`` takes no metadata: a model's facts are in its config."""


@dataclass(frozen=True)
class DrafterInfo:
    """``register_drafters`` metadata."""

    needs_model: bool | None = parsed(flag)  # whether speculative.model is required
    # Plugin API 1.0 documented drafter metadata as free-form: other keys stay
    # here, with a warning that names them.
    extra: Mapping[str, object] = free_form()


@dataclass(frozen=True)
class SpecPolicyInfo:
    """``register_spec_policies`` metadata: none (the policy's class is all)."""


@dataclass(frozen=True)
class GrammarBackendInfo:
    """``register_grammar_backends`` metadata (informational)."""

    kinds: tuple[str, ...] | None = parsed(names)  # spec kinds it compiles
    requires: tuple[str, ...] = parsed(names, ())  # import names of the packages it needs


@dataclass(frozen=True)
class KVConnectorInfo:
    """``register_kv_connectors`` metadata."""

    # kv_transfer.role values it supports; None = every role.
    roles: tuple[str, ...] | None = parsed(names)
    # Whether it runs at parallel.tensor_parallel_size > 1: its metadata is
    # plain data (sent to every rank) and each rank moves its own shard.
    supports_tensor_parallel: bool = parsed(flag, False)


@dataclass(frozen=True)
class ModelSourceInfo:
    """``register_model_sources`` metadata: none (the source answers for itself)."""


@dataclass(frozen=True)
class ExecutorInfo:
    """``register_executors`` metadata."""

    # Whether it runs parallel.tensor_parallel_size > 1 (several ranks).
    supports_tensor_parallel: bool = parsed(flag, False)
    requires: tuple[str, ...] = parsed(names, ())  # import names of the packages it needs


@dataclass(frozen=True)
class RouterInfo:
    """``register_routers`` metadata: none (the policy's class says what it reads)."""


@dataclass(frozen=True)
class QuantizationInfo:
    """``register_quantization_methods`` metadata: where the method runs."""

    device_types: tuple[str, ...] | None = parsed(names)  # "cpu", "cuda", ...; None = any
    dtypes: tuple[str, ...] | None = parsed(dtype_names)  # compute dtypes; None = any
    requires: tuple[str, ...] = parsed(names, ())  # import names of the packages it needs
    # The checkpoint formats it reads (config.json quantization_config.quant_method
    # values: "gptq", "awq", "compressed-tensors"; plugin API 1.14): a checkpoint in
    # one of them is served by this method without `model.quantization`.
    checkpoint_formats: tuple[str, ...] = parsed(names, ())
    # Whether it quantizes a float checkpoint at load (`model.quantization` on a
    # float checkpoint); False for a method that only reads its own format.
    quantizes_float: bool = parsed(flag, True)


@dataclass(frozen=True)
class ToolParserInfo:
    """``register_tool_parsers`` metadata: none (the parser reads the text itself)."""


@dataclass(frozen=True)
class ReasoningParserInfo:
    """``register_reasoning_parsers`` metadata: none (the parser reads its tags from the tokenizer)."""


@dataclass(frozen=True)
class LogitsProcessorInfo:
    """``register_logits_processors`` metadata."""

    # The SamplingParams.extra_args keys (the server's vllm_xargs) that activate
    # it: a request passing one to a server that does not load the processor
    # is refused, naming the processor, instead of silently ignored.
    args: tuple[str, ...] = parsed(names, ())


@dataclass(frozen=True)
class StatLoggerInfo:
    """``register_stat_loggers`` metadata: none (the logger's class is all)."""


@dataclass(frozen=True)
class LoRAResolverInfo:
    """``register_lora_resolvers`` metadata: none (the resolver's class is all)."""


__all__ = [
    "DrafterInfo",
    "ExecutorInfo",
    "GrammarBackendInfo",
    "KVConnectorInfo",
    "LoRAResolverInfo",
    "LogitsProcessorInfo",
    "MetadataError",
    "ModelInfo",
    "ModelSourceInfo",
    "PlatformInfo",
    "QuantizationInfo",
    "ReasoningParserInfo",
    "RouterInfo",
    "SpecPolicyInfo",
    "StatLoggerInfo",
    "ToolParserInfo",
    "build_info",
    "capability",
    "count",
    "counts",
    "dtype_names",
    "flag",
    "free_form",
    "name",
    "names",
    "parsed",
]
