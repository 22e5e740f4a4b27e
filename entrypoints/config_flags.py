"""Command-line flags for every EngineConfig field, generated from the
pydantic section models so that a new field gets its flag automatically.

Flag names: vLLM's flat name where `FLAT_KEYS` has one (`--block-size`,
`--enabled-plugins`), else the key when no other section has it
(`--api-key`), else `--<section>-<key>`. Booleans are `--x/--no-x`, lists are
comma-separated (those of `SPACE_SEPARATED_LISTS`: one word per item);
`--plugin-config NAME='{"key": 1}'` (repeatable) sets one plugin's options.
Only flags actually given become overrides, so env and the config file still
apply underneath them.
"""

from __future__ import annotations

import argparse
import json
import typing
from collections import Counter
from types import NoneType, UnionType
from typing import Any, Literal

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from pagedllm.core.config import FLAT_KEYS, EngineConfig

_DEST_PREFIX = "engine_config__"
# Flags the command defines itself, never generated from a field.
RESERVED_NAMES = frozenset({"config", "help", "model"})
# vLLM's short spellings, accepted beside the long flag.
# The field whose flag takes one plugin's options at a time (NAME=JSON).
PLUGIN_CONFIG_PATH = "plugins.config"
SHORT_FLAGS: dict[tuple[str, str], str] = {
    ("parallel", "tensor_parallel_size"): "-tp",
    ("parallel", "data_parallel_size"): "-dp",
}
# List fields whose flag takes its items as separate words, as vLLM's
# (`--served-model-name A B`; a name may hold a comma).
SPACE_SEPARATED_LISTS = frozenset({"server.served_model_name", "lora.lora_modules"})
# A renamed field's old flag, still accepted beside the new one.
ALIAS_FLAGS: dict[tuple[str, str], str] = {
    ("device", "graph_sizes"): "--cuda-graph-sizes",
}


def section_models() -> dict[str, type[BaseModel]]:
    return {
        name: typing.cast(type[BaseModel], field.annotation) for name, field in EngineConfig.model_fields.items()
    }


def flag_names() -> dict[tuple[str, str], str]:
    """(section, key) -> the flag's main name (underscores, no dashes)."""
    flat_names: dict[tuple[str, str], str] = {}
    for flat_name, (section, key) in FLAT_KEYS.items():
        if key is None:
            continue
        if (section, key) not in flat_names or flat_name == key:
            flat_names[(section, key)] = flat_name
    sections = section_models()
    key_counts = Counter(key for model in sections.values() for key in model.model_fields)
    names: dict[tuple[str, str], str] = {}
    for section, model in sections.items():
        for key in model.model_fields:
            name = flat_names.get((section, key))
            if name is None:
                name = key if key_counts[key] == 1 and key not in RESERVED_NAMES else f"{section}_{key}"
            names[(section, key)] = name
    return names


def add_engine_config_flags(parser: argparse.ArgumentParser, skip: frozenset[tuple[str, str]] = frozenset()) -> None:
    names = flag_names()
    for section, model in section_models().items():
        group = parser.add_argument_group(f"{section} (config section '{section}', env PAGEDLLM_{section.upper()}__*)")
        for key, field in model.model_fields.items():
            if (section, key) in skip:
                continue
            dest = f"{_DEST_PREFIX}{section}__{key}"
            flags = [_flag(names[(section, key)])]
            if (section, key) in SHORT_FLAGS:
                flags.append(SHORT_FLAGS[(section, key)])
            if (section, key) in ALIAS_FLAGS:
                flags.append(ALIAS_FLAGS[(section, key)])
            _add_field_flag(group, flags, dest, field, f"{section}.{key}")


def add_plugin_config_flags(parser: argparse.ArgumentParser) -> None:
    """`--config FILE` and `--plugin-config NAME=JSON` alone, for a command that
    reads only the plugins' options (`pagedllm plugins list`)."""
    parser.add_argument("--config", default=None, metavar="FILE", help="engine config file (.yaml, .yml, .toml)")
    field = section_models()["plugins"].model_fields["config"]
    _add_field_flag(parser.add_argument_group("plugin options"), ["--plugin-config"],
                    f"{_DEST_PREFIX}plugins__config", field, PLUGIN_CONFIG_PATH)


def engine_config_overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} for the flags given on the command line."""
    overrides: dict[str, dict[str, Any]] = {}
    for dest, value in vars(args).items():
        if dest.startswith(_DEST_PREFIX):
            section, key = dest[len(_DEST_PREFIX):].split("__", 1)
            overrides.setdefault(section, {})[key] = value
    return overrides


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _add_field_flag(
    group: argparse._ArgumentGroup, flags: list[str], dest: str, field: FieldInfo, path: str
) -> None:
    annotation = _strip_optional(field.annotation)
    default = field.get_default(call_default_factory=True)
    help_text = (field.description + " " if field.description else "") + f"({path}; default: {default!r})"
    common: dict[str, Any] = dict(dest=dest, default=argparse.SUPPRESS, help=help_text)
    if annotation is bool:
        group.add_argument(*flags, action=argparse.BooleanOptionalAction, **common)
        return
    if path == PLUGIN_CONFIG_PATH:
        group.add_argument(*flags, type=_plugin_options, action=_MergePluginOptions, metavar="NAME=JSON", **common)
        return
    if path in SPACE_SEPARATED_LISTS:
        group.add_argument(*flags, nargs="+", metavar="NAME", **common)
        return
    if typing.get_origin(annotation) is list:
        group.add_argument(*flags, type=_comma_list, metavar="A,B,...", **common)
        return
    if annotation is dict or typing.get_origin(annotation) is dict:
        group.add_argument(*flags, type=_json_object, metavar="JSON", **common)
        return
    if typing.get_origin(annotation) is Literal:
        choices = [str(choice) for choice in typing.get_args(annotation)]
        group.add_argument(*flags, type=str, metavar="{" + ",".join(choices) + "}", **common)
        return
    scalar = annotation if annotation in (int, float) else str
    group.add_argument(*flags, type=scalar, metavar=scalar.__name__.upper(), **common)


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not NoneType]
        if len(args) == 1:
            return args[0]
    return annotation


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("expected a JSON object")
    return parsed


class _MergePluginOptions(argparse.Action):
    """Each `--plugin-config NAME=JSON` adds NAME's options; a plugin named
    twice gets both objects' keys (the later flag wins a key given twice)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        name, options = values
        merged = dict(getattr(namespace, self.dest, None) or {})
        merged[name] = {**merged.get(name, {}), **options}
        setattr(namespace, self.dest, merged)


def _plugin_options(value: str) -> tuple[str, dict[str, Any]]:
    name, sep, options = value.partition("=")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"expected NAME='{{\"key\": value}}', got {value!r}")
    return name.strip(), _json_object(options)


def _comma_list(value: str) -> list[str]:
    return [item.strip() for item in value.split(",") if item.strip()]
