"""Function calling on /v1/chat/completions (OpenAI `tools`, `tool_choice`,
`parallel_tool_calls`), as vLLM does it:

- `none`: the model answers in text (the tools are still shown to the template);
- `required` / a named function: the grammar backend forces JSON built from the
  tools' parameter schemas, so the output always parses into calls;
- `auto`: the model writes calls its own way, and the server's tool-call parser
  (`--tool-call-parser`, a `tool_parser` plugin, with `--enable-auto-tool-choice`)
  reads them out of the text.

`plan_tool_calls` validates a request and says which; `ChoiceToolCalls`
(tool_call_output.py) turns one choice's text into content and `tool_calls`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.int_limits import short_value
from pagedllm.core.sampling_params import StructuredOutputsParams
from pagedllm.entrypoints.openai.protocol import ChatMessage
from pagedllm.tool_parsers.base import ToolParser, ToolRequest, ToolSpec

if TYPE_CHECKING:
    from pagedllm.core.config import ServerConfig
    from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest

# Deepest a tool's parameter schema may nest, and the most characters all of
# them may take together (JSON text): they reach the template and the grammar.
MAX_TOOL_SCHEMA_DEPTH = 32
MAX_TOOLS_SCHEMA_CHARS = 1 << 18
# Most calls one `required` turn may make with parallel_tool_calls: a bound
# keeps the forced language finite, so a weak model cannot loop to max_tokens.
MAX_PARALLEL_TOOL_CALLS = 16
# A call's arguments when its tool declares no parameters.
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}

ToolMode = Literal["none", "auto", "required", "named"]


def load_tool_parser(server_config: ServerConfig) -> type[ToolParser] | None:
    """The configured parser class (None when auto tool choice is off);
    ConfigError at start for a missing or unknown name."""
    name = server_config.tool_call_parser
    if not server_config.enable_auto_tool_choice:
        return None
    from pagedllm.plugins import get_plugin_manager

    registry = get_plugin_manager().tool_parsers
    if name is None:
        raise ConfigError(
            "server.enable_auto_tool_choice", True,
            "only together with --tool-call-parser NAME (registered: " + ", ".join(registry.names()) + ")",
        )
    if name not in registry:
        raise ConfigError("server.tool_call_parser", name, ", ".join(registry.names()) or "none registered")
    return registry.load(name)


@dataclass(frozen=True)
class ToolCallPlan:
    """What a request asks of function calling, validated."""

    mode: ToolMode
    tool_request: ToolRequest
    named: str | None = None
    parallel: bool = True
    parser_cls: type[ToolParser] | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools` a chat template receives (HF's format: OpenAI's)."""
        if not self.tool_request.tools:
            return None
        return [
            {"type": "function", "function": {
                "name": tool.name, **({"description": tool.description} if tool.description else {}),
                "parameters": tool.parameters,
            }}
            for tool in self.tool_request.tools
        ]

    def structured_outputs(self) -> StructuredOutputsParams | None:
        """The JSON schema that forces `required` and named calls (vLLM's)."""
        if self.mode == "named":
            return StructuredOutputsParams(json=self._parameters(self.named))
        if self.mode != "required":
            return None
        calls = {
            "anyOf": [
                {"type": "object", "properties": {"name": {"type": "string", "enum": [tool.name]},
                                                  "parameters": tool.parameters or EMPTY_PARAMETERS},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for tool in self.tool_request.tools
            ]
        }
        max_items = MAX_PARALLEL_TOOL_CALLS if self.parallel else 1
        return StructuredOutputsParams(json={"type": "array", "minItems": 1, "maxItems": max_items, "items": calls})

    def _parameters(self, name: str | None) -> dict[str, Any]:
        tool = next(tool for tool in self.tool_request.tools if tool.name == name)
        return tool.parameters or EMPTY_PARAMETERS


def plan_tool_calls(request: ChatCompletionRequest, parser_cls: type[ToolParser] | None) -> ToolCallPlan:
    """Check `tools` and `tool_choice`; InvalidRequestError names the field."""
    tools = _tool_specs(request)  # the messages' calls are checked where they are rendered (render_chat)
    choice = request.tool_choice
    if choice is not None and not tools:
        raise InvalidRequestError("tool_choice", _choice_value(choice), "is only allowed when tools are given")
    if choice is None:
        choice = "auto" if tools else "none"
    tool_request = ToolRequest(tuple(tools))
    if choice == "none":
        return ToolCallPlan("none", tool_request)
    if request.response_format is not None or request.structured_outputs is not None:
        field = "response_format" if request.response_format is not None else "structured_outputs"
        raise InvalidRequestError(field, "<set>", f"cannot be combined with tool_choice={_choice_value(choice)!r}")
    if choice == "auto":
        if parser_cls is None:
            raise InvalidRequestError(
                "tool_choice", "auto", "\"auto\" tool choice requires the server to run with "
                "--enable-auto-tool-choice and --tool-call-parser NAME (use \"required\", a named function "
                "or \"none\" instead)",
            )
        return ToolCallPlan("auto", tool_request, parallel=request.parallel_tool_calls, parser_cls=parser_cls)
    if choice == "required":
        return ToolCallPlan("required", tool_request, parallel=request.parallel_tool_calls)
    name = choice.function.name
    if name not in tool_request.names():
        raise InvalidRequestError(
            "tool_choice.function.name", name, "names no tool in tools (" + ", ".join(sorted(tool_request.names()))
            + ")",
        )
    return ToolCallPlan("named", tool_request, named=name, parallel=request.parallel_tool_calls)


def _choice_value(choice: Any) -> Any:
    return choice if isinstance(choice, str) else choice.model_dump()


def _tool_specs(request: ChatCompletionRequest) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    num_schema_chars = 0
    for position, tool in enumerate(request.tools or []):
        function = tool.function
        field = f"tools.{position}.function"
        if function.name in seen:
            raise InvalidRequestError(f"{field}.name", function.name, "two tools have this name; names must be unique")
        seen.add(function.name)
        parameters = function.parameters or {}
        depth = _depth(parameters, MAX_TOOL_SCHEMA_DEPTH)
        if depth > MAX_TOOL_SCHEMA_DEPTH:
            raise InvalidRequestError(
                f"{field}.parameters", f"<schema nested deeper than {MAX_TOOL_SCHEMA_DEPTH}>",
                f"a tool's parameter schema may nest at most {MAX_TOOL_SCHEMA_DEPTH} levels",
            )
        if parameters and parameters.get("type", "object") != "object":
            raise InvalidRequestError(
                f"{field}.parameters.type", short_value(parameters.get("type")),
                "must be \"object\" (a call's arguments are an object)",
            )
        num_schema_chars += len(json.dumps(parameters))
        if num_schema_chars > MAX_TOOLS_SCHEMA_CHARS:
            raise InvalidRequestError(
                f"{field}.parameters", f"<{num_schema_chars} characters so far>",
                f"the tools' parameter schemas may take at most {MAX_TOOLS_SCHEMA_CHARS} characters of JSON together",
            )
        specs.append(ToolSpec(function.name, parameters, function.description))
    return specs


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of dicts and lists, iteratively, stopping past `limit`."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 1)] if isinstance(value, (dict, list)) else []
    while stack:
        node, depth = stack.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            return deepest
        children = node.values() if isinstance(node, dict) else node
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return deepest


def check_tool_messages(messages: list[ChatMessage]) -> None:
    """Calls only on assistant messages (arguments: a JSON object), and a
    `tool_call_id` on every tool message."""
    for position, message in enumerate(messages):
        field = f"messages.{position}"
        if message.tool_calls is not None and message.role != "assistant":
            raise InvalidRequestError(f"{field}.tool_calls", "<set>", f"only assistant messages have tool_calls, "
                                      f"not role {message.role!r}")
        if message.role == "tool" and message.tool_call_id is None:
            raise InvalidRequestError(f"{field}.tool_call_id", None, "a tool message must name the call it answers")
        for number, call in enumerate(message.tool_calls or []):
            _call_arguments(call.function.arguments, f"{field}.tool_calls.{number}.function.arguments")


def _call_arguments(arguments: str, field: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments)
    except (ValueError, RecursionError):
        value = None
    if not isinstance(value, dict):
        raise InvalidRequestError(field, short_value(arguments), "must be JSON text of an object")
    return value


def template_message(message: ChatMessage) -> dict[str, Any]:
    """A message as HF chat templates read it: calls' arguments as dicts (as
    vLLM passes them; templates write them with `tojson`)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls is not None:
        rendered["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {
                "name": call.function.name, "arguments": _call_arguments(call.function.arguments, "arguments"),
            }}
            for call in message.tool_calls
        ]
    return rendered
