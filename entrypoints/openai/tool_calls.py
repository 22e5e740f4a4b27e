"""Function calling on /v1/chat/completions (OpenAI `tools`, `tool_choice`,
`parallel_tool_calls`), as vLLM does it:

- `none`: the model answers in text (the tools are still shown to the template);
- `required` / a named function: the grammar backend forces JSON built from the
  tools' parameter schemas, so the output always parses into calls;
- `auto`: the model writes calls its own way, and the server's tool-call parser
  (`--tool-call-parser`, a `tool_parser` plugin, with `--enable-auto-tool-choice`)
  reads them out of the text.

`plan_tool_calls` validates a request and says which; `ChoiceToolCalls` turns
one choice's text into content and `tool_calls`, whole or streamed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pagedllm.core.errors import ConfigError, InvalidRequestError
from pagedllm.core.int_limits import short_value
from pagedllm.core.sampling_params import StructuredOutputsParams
from pagedllm.entrypoints.openai.forced_tool_calls import ForcedCallsReader, read_forced_calls
from pagedllm.entrypoints.openai.protocol import (
    ChatMessage,
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedllm.tool_parsers.base import ToolParser, ToolParserDelta, ToolRequest, ToolSpec

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


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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
    """Check `tools`, `tool_choice` and the messages' calls; InvalidRequestError names the field."""
    tools = _tool_specs(request)
    check_tool_messages(request.messages)
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


class ChoiceToolCalls:
    """One choice's text as content and calls: `complete` for a whole output,
    `stream` for each delta (then the finish reason through `finish_reason`)."""

    def __init__(self, plan: ToolCallPlan, tokenizer: Any) -> None:
        self.plan = plan
        self.parser = plan.parser_cls(tokenizer) if plan.parser_cls is not None else None
        self.text = ""
        self.call_ids: list[str] = []
        self.forced_reader = ForcedCallsReader()

    # ---- a whole output ----------------------------------------------------

    def complete(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        content, calls = self._split_whole(text)
        tool_calls = [ToolCall(id=make_tool_call_id(), function=call) for call in calls]
        message = ChatResponseMessage(content=content, tool_calls=tool_calls or None)
        return message, self._finish(finish_reason, bool(calls))

    def _split_whole(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        if self.plan.mode == "named":
            return None, [FunctionCall(name=self.plan.named or "", arguments=text)]
        if self.plan.mode == "required":
            calls = [FunctionCall(name=name, arguments=arguments) for name, arguments in read_forced_calls(text)]
            return (None, calls) if calls else (text, [])
        if self.parser is not None:
            result = self.parser.extract_tool_calls(text, self.plan.tool_request)
            return result.content, [FunctionCall(name=c.name, arguments=c.arguments) for c in result.tool_calls]
        return text, []

    def _finish(self, finish_reason: str | None, called: bool) -> str | None:
        # OpenAI: a turn that ends in calls ends with "tool_calls"; a cut one stays "length".
        return "tool_calls" if called and finish_reason == "stop" else finish_reason

    # ---- a stream ----------------------------------------------------------

    def stream(self, delta_text: str, finished: bool) -> list[DeltaMessage]:
        """The deltas to send for `delta_text` (the last one when `finished`)."""
        previous_text, self.text = self.text, self.text + delta_text
        if self.plan.mode == "named":
            pieces = [] if self.call_ids or not (delta_text or finished) else [
                self._piece(0, name=self.plan.named, arguments="")]
            return pieces + ([self._piece(0, arguments=delta_text)] if delta_text else [])
        if self.plan.mode == "required":
            return self._required(delta_text, finished)
        if self.parser is None:
            return [DeltaMessage(content=delta_text)] if delta_text else []
        released = self.parser.extract_tool_calls_streaming(
            previous_text, self.text, delta_text, self.plan.tool_request
        )
        deltas = self._deltas(released)
        if finished:
            deltas += self._deltas(self.parser.finish_streaming(self.text, self.plan.tool_request))
        return deltas

    def finish_reason(self, finish_reason: str | None) -> str | None:
        return self._finish(finish_reason, bool(self.call_ids)) if finish_reason is not None else None

    def _required(self, delta_text: str, finished: bool) -> list[DeltaMessage]:
        self.forced_reader.feed(delta_text)
        deltas = [self._piece(index, name, arguments) for index, name, arguments in self.forced_reader.take_pieces()]
        if finished and not self.forced_reader.calls and self.text:
            deltas.append(DeltaMessage(content=self.text))  # no call even started: the text, as whole responses do
        return deltas

    def _deltas(self, released: ToolParserDelta | None) -> list[DeltaMessage]:
        if released is None:
            return []
        deltas = [DeltaMessage(content=released.content)] if released.content else []
        for piece in released.tool_calls:
            deltas.append(self._piece(piece.index, name=piece.name, arguments=piece.arguments))
        return deltas

    def _piece(self, index: int, name: str | None = None, arguments: str | None = None) -> DeltaMessage:
        function = DeltaFunctionCall(name=name, arguments=arguments)
        if name is not None:  # a call's first piece: its id and type too
            while len(self.call_ids) <= index:
                self.call_ids.append(make_tool_call_id())
            call = DeltaToolCall(index=index, id=self.call_ids[index], type="function", function=function)
        else:
            call = DeltaToolCall(index=index, function=function)
        return DeltaMessage(tool_calls=[call])

