"""One choice's model text as OpenAI content and `tool_calls`, for the
plan `tool_calls.plan_tool_calls` made: whole (`complete`) or delta by
delta (`stream`), the two always agreeing."""

from __future__ import annotations

import uuid
from typing import Any

from pagedllm.entrypoints.openai.forced_tool_calls import ForcedCallsReader, read_forced_calls
from pagedllm.entrypoints.openai.protocol import (
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)
from pagedllm.entrypoints.openai.tool_calls import ToolCallPlan
from pagedllm.tool_parsers.base import ToolParserDelta


def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


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

