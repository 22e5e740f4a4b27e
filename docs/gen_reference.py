"""The reference pages, generated from the code when the site is built.

A mkdocs hook (`hooks:` in mkdocs.yml): `on_files` adds, as generated pages,

- `reference/config.md`: every `EngineConfig` field with its type, default,
  environment variable, command-line flag and `LLM(...)` keyword;
- `reference/cli.md`: every command and flag of `pagedllm`, from its parser;
- `reference/hooks.md`: every hook of `plugins/hookspecs.py`, its signature and
  the plugin API version that added it;
- `reference/routes.md`: every HTTP route of the server's OpenAPI document;
- `index.md`: the README, its `docs/` links made site-relative.

Nothing is written into the repository, so a page cannot go stale; the
builders are plain functions that tests/test_docs_reference.py calls too.
"""

from __future__ import annotations

import argparse
import inspect
import re
import typing
from pathlib import Path
from types import NoneType, SimpleNamespace, UnionType
from typing import Any, Literal

ROOT = Path(__file__).resolve().parent.parent


# ---- helpers -------------------------------------------------------------------


def _cell(text: str) -> str:
    """Text for one cell of a Markdown table."""
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def type_name(annotation: Any) -> str:
    """`int | None`, `"auto" | "fp8"`, `list[str]` for an annotation."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return " | ".join(repr(arg).replace("'", '"') for arg in typing.get_args(annotation))
    if origin in (typing.Union, UnionType):
        return " | ".join(type_name(arg) for arg in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(type_name(arg) for arg in typing.get_args(annotation))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if annotation is NoneType:
        return "None"
    if annotation is Any:
        return "Any"
    return getattr(annotation, "__name__", str(annotation))


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment lines right above it in the class's source
    (the config sections document their fields that way)."""
    comments: dict[str, str] = {}
    pending: list[str] = []
    for line in inspect.getsource(cls).splitlines()[1:]:
        stripped = line.strip()
        if line.startswith("    # ") or line.rstrip() == "    #":
            pending.append(stripped.lstrip("#").strip().removeprefix("NOTE:").strip())
            continue
        match = re.match(r"^    (\w+):", line)
        if match:
            comments[match.group(1)] = " ".join(pending)
        if not line.startswith("        "):  # a continuation line keeps the comment for nobody
            pending = []
    return comments


# ---- configuration -------------------------------------------------------------------


def config_entries() -> list[dict[str, str]]:
    """One entry per `EngineConfig` field: section, key, type, default, env, flag, keyword, description."""
    from pagedllm.core.config import FLAT_KEYS
    from pagedllm.entrypoints.config_flags import SHORT_FLAGS, flag_names, section_models

    flags = flag_names()
    keywords: dict[tuple[str, str | None], list[str]] = {}
    for flat_name, target in FLAT_KEYS.items():
        keywords.setdefault(target, []).append(flat_name)
    entries = []
    for section, model in section_models().items():
        comments = field_comments(model)
        for key, field in model.model_fields.items():
            flag = "MODEL, --model" if (section, key) == ("model", "model") else _flag_text(flags, section, key, field)
            if (section, key) in SHORT_FLAGS:
                flag += f", {SHORT_FLAGS[(section, key)]}"
            entries.append({
                "section": section,
                "key": key,
                "type": type_name(field.annotation),
                "default": repr(field.get_default(call_default_factory=True)),
                "env": f"PAGEDLLM_{section.upper()}__{key.upper()}",
                "flag": flag,
                "keyword": ", ".join(keywords.get((section, key), [])),
                "description": field.description or comments.get(key, ""),
            })
    return entries


def _flag_text(flags: dict[tuple[str, str], str], section: str, key: str, field: Any) -> str:
    flag = "--" + flags[(section, key)].replace("_", "-")
    annotation = field.annotation
    if annotation is bool:
        return f"{flag}, --no-{flag[2:]}"
    if (section, key) == ("plugins", "config"):
        return "--plugin-config NAME=JSON"
    return flag


def config_page() -> str:
    from pagedllm.core.config import FLAT_KEYS
    from pagedllm.entrypoints.config_flags import section_models

    lines = [
        "# Configuration reference",
        "",
        "Generated from `core/config.py` when the site is built. Every field of `EngineConfig`, section by",
        "section: its type, its default, the environment variable and the `pagedllm serve` flag that set it,",
        "and the flat `LLM(...)` keyword (vLLM's name) where there is one. Sources, highest first: arguments",
        "and flags, the environment, the config file (`--config FILE`, YAML or TOML), the defaults",
        "([Configuration](../configuration.md)).",
        "",
    ]
    by_section: dict[str, list[dict[str, str]]] = {}
    for entry in config_entries():
        by_section.setdefault(entry["section"], []).append(entry)
    whole_section = {target[0]: name for name, target in FLAT_KEYS.items() if target[1] is None}
    for section in section_models():
        lines += [f"## `{section}`", ""]
        if section in whole_section:
            lines += [f"The whole section is also `LLM({whole_section[section]}={{...}})`.", ""]
        lines += ["| field | type | default | env / flag / `LLM` keyword | description |", "|---|---|---|---|---|"]
        for e in by_section[section]:
            where = "<br>".join(_code(part) for part in (e["env"], e["flag"], e["keyword"]) if part)
            lines.append(
                f"| `{section}.{e['key']}` | {_cell(_code(e['type']))} | {_cell(_code(e['default']))} | "
                f"{_cell(where)} | {_cell(e['description'])} |"
            )
        lines.append("")
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------


def cli_commands() -> dict[str, argparse.ArgumentParser]:
    """`pagedllm ...` command path -> its parser, every subcommand included."""
    from pagedllm.entrypoints.cli import build_parser

    commands: dict[str, argparse.ArgumentParser] = {}

    def walk(prefix: str, parser: argparse.ArgumentParser) -> None:
        commands[prefix] = parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    walk(f"{prefix} {name}", sub)

    walk("pagedllm", build_parser())
    return commands


def _arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [
        action for action in parser._actions
        if not isinstance(action, (argparse._SubParsersAction, argparse._HelpAction))
    ]


def _argument_row(action: argparse.Action) -> str:
    names = ", ".join(action.option_strings) or (action.metavar or action.dest)
    if isinstance(action, argparse.BooleanOptionalAction) or action.nargs == 0:
        value = ""
    elif action.choices:
        value = "{" + ",".join(str(choice) for choice in action.choices) + "}"
    else:
        value = str(action.metavar or (action.dest.upper() if action.option_strings else ""))
    if action.default is argparse.SUPPRESS:
        default = "(config)"
    elif action.default is None or action.nargs == 0:
        default = ""
    else:
        default = _code(repr(action.default))
    required = " (required)" if action.required and action.option_strings else ""
    help_text = (action.help or "") % {"default": action.default} if action.help else ""
    return f"| `{names}`{required} | {_cell(_code(value))} | {_cell(default)} | {_cell(help_text)} |"


def cli_page() -> str:
    lines = [
        "# Command-line reference",
        "",
        "Generated from `entrypoints/cli.py`'s parser when the site is built: every `pagedllm` command and",
        "flag. `(config)` as a default: the flag sets an `EngineConfig` field only when given, so the",
        "environment and the config file still apply beneath it ([configuration reference](config.md)).",
        "",
    ]
    for command, parser in cli_commands().items():
        actions = _arguments(parser)
        subcommands = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        lines += [f"## `{command}`", ""]
        if parser.description:
            lines += [parser.description, ""]
        for sub in subcommands:
            for choice in sub._choices_actions:
                lines.append(f"- `{command} {choice.dest}`: {choice.help or ''}")
            lines.append("")
        if not actions:
            continue
        lines += ["| argument | value | default | help |", "|---|---|---|---|"]
        lines += [_argument_row(action) for action in actions]
        lines.append("")
    return "\n".join(lines)


# ---- plugin hooks -------------------------------------------------------------------


def hook_specs() -> dict[str, Any]:
    from pagedllm.plugins import hookspecs

    return {
        name: fn for name, fn in sorted(vars(hookspecs).items())
        if callable(fn) and getattr(fn, "pagedllm_spec", None) is not None
    }


def hook_versions() -> dict[str, str]:
    """Hook name -> the plugin API version that added it, read from the version
    history in plugins/compat.py (a hook it never names is from 1.0)."""
    from pagedllm.plugins import compat

    added: dict[str, str] = {}
    for version, block in re.findall(r"^# (\d+\.\d+): (.*?)(?=^# \d+\.\d+: |^[^#]|\Z)",
                                     inspect.getsource(compat), flags=re.M | re.S):
        for name in re.findall(r"`(register_\w+|on_\w+)`", block):
            added.setdefault(name, f"{version}.0")
    return {name: added.get(name, "1.0.0") for name in hook_specs()}


def hooks_page() -> str:
    from pagedllm.plugins import API_VERSION

    versions = hook_versions()
    lines = [
        "# Plugin hooks reference",
        "",
        f"Generated from `plugins/hookspecs.py` when the site is built: plugin API {API_VERSION}. How to",
        "write each kind, with examples: [Writing plugins](../plugins.md).",
        "",
        "| hook | added in | firstresult |",
        "|---|---|---|",
    ]
    specs = hook_specs()
    for name, fn in specs.items():
        first = "yes" if fn.pagedllm_spec.get("firstresult") else "no"
        lines.append(f"| [`{name}`](#{name}) | {versions[name]} | {first} |")
    lines.append("")
    for name, fn in specs.items():
        lines += [
            f"## `{name}`",
            "",
            f"Added in plugin API {versions[name]}.",
            "",
            "```python",
            f"def {name}{inspect.signature(fn)}".replace("'", ""),
            "```",
            "",
            "```text",
            inspect.cleandoc(fn.__doc__ or ""),
            "```",
            "",
        ]
    return "\n".join(lines)


# ---- HTTP routes -------------------------------------------------------------------


def openapi_document() -> dict[str, Any]:
    """The server's OpenAPI document, from an app built around a stand-in engine."""
    from pagedllm.core.config import EngineConfig
    from pagedllm.entrypoints.openai.api_server import build_app
    from pagedllm.model_registry.tiny import TARGET_MODEL_NAME, get_tokenizer_dir
    from pagedllm.model_registry.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(str(get_tokenizer_dir()))
    # The runtime LoRA routes are mounted only when allowed: document them too.
    config = EngineConfig.model_validate({"lora": {"enable_lora": True, "allow_runtime_lora_updating": True}})
    engine = SimpleNamespace(
        tokenizer=tokenizer, model_name=TARGET_MODEL_NAME, max_model_len=2048, vocab_size=len(tokenizer),
        config=config, shutdown=lambda: None,
    )
    return build_app(engine, config).openapi()  # type: ignore[arg-type]


def route_entries(document: dict[str, Any]) -> list[tuple[str, str, dict[str, Any]]]:
    """(METHOD, path, operation) for every operation of the document."""
    return [
        (method.upper(), path, operation)
        for path, item in document["paths"].items()
        for method, operation in item.items()
    ]


def routes_page(document: dict[str, Any] | None = None) -> str:
    document = openapi_document() if document is None else document
    lines = [
        "# HTTP routes reference",
        "",
        "Generated from the server's OpenAPI document (`GET /openapi.json`) when the site is built. A",
        "running server's own document also states its limits (vocabulary size, trusted chat templates) and,",
        "with `--api-key`, which routes need the key ([Serving and the API](../serving.md)).",
        "",
        "| route | summary | answers |",
        "|---|---|---|",
    ]
    for method, path, operation in route_entries(document):
        codes = ", ".join(sorted(operation.get("responses", {})))
        lines.append(f"| `{method} {path}` | {_cell(operation.get('summary', ''))} | {codes} |")
    lines.append("")
    for method, path, operation in route_entries(document):
        lines += [f"## `{method} {path}`", ""]
        if operation.get("description"):
            lines += [inspect.cleandoc(operation["description"]), ""]
        for parameter in operation.get("parameters", []):
            schema = parameter.get("schema", {})
            kind = " | ".join(option.get("type", "?") for option in schema.get("anyOf", [schema]))
            required = "required" if parameter.get("required") else "optional"
            lines += [f"Parameter `{parameter['name']}` ({parameter['in']}, {kind}, {required}).", ""]
        body = operation.get("requestBody", {}).get("content", {})
        for media_type, content in body.items():
            ref = content.get("schema", {}).get("$ref", "")
            lines += [f"Body: `{media_type}`" + (f", schema `{ref.rsplit('/', 1)[-1]}`." if ref else "."), ""]
        for code, response in sorted(operation.get("responses", {}).items()):
            lines.append(f"- {code}: {_cell(response.get('description', ''))}")
        lines.append("")
    return "\n".join(lines)


# ---- the front page -------------------------------------------------------------------


def front_page() -> str:
    """The README, as the site's home page: `docs/x.md` links become `x.md`."""
    return re.sub(r"\]\(docs/", "](", (ROOT / "README.md").read_text(encoding="utf-8"))


PAGES = {
    "reference/config.md": config_page,
    "reference/cli.md": cli_page,
    "reference/hooks.md": hooks_page,
    "reference/routes.md": routes_page,
    "index.md": front_page,
}


def on_files(files: Any, config: Any) -> Any:
    """mkdocs hook: add the generated pages to the site's files."""
    from mkdocs.structure.files import File

    for uri, build in PAGES.items():
        files.append(File.generated(config, uri, content=build()))
    return files
