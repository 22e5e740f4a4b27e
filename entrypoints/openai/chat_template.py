"""Chat templates rendered under a time limit and an output bound.

A chat template is code: jinja2's sandbox stops it from touching the
process, but not from looping for minutes (`range` is capped at 100,000
items, yet loops nest) or from emitting gigabytes. So every render, the
model's own template included, runs in a request worker thread with a
`sys.settrace` tracer installed for that thread only, for the duration of
the render:

- on every call, and on every line of template code (jinja compiles a
  template to Python functions in the file "<template>"), it checks the
  deadline and, once it has passed, raises inside the template;
- it adds up what the template's root function yields and stops the render
  once that exceeds `max_chars`.

What remains: a single C-level operation (`'a' * 10**9`, `'x'.ljust(n)`,
`10 ** 10 ** 7`) runs to its end before the tracer sees it, so it can still
allocate (or spin) that much once; hence request-supplied templates stay off
unless the operator trusts them (`server.trust_request_chat_template`).
"""

from __future__ import annotations

import sys
import time
from types import FrameType
from typing import Any

from pagedllm.core.errors import InvalidRequestError

# jinja2 compiles `Environment.from_string` templates into this file name.
TEMPLATE_FILENAME = "<template>"
# The function of a compiled template that yields the rendered pieces.
TEMPLATE_ROOT_FUNCTION = "root"

# Arguments of the renderer itself (transformers' apply_chat_template and the
# variables it sets): `chat_template_kwargs` may not name them.
RENDERER_ARGUMENTS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
})


class _RenderStopped(BaseException):
    """Raised by the tracer inside the render. A BaseException so that no
    `except Exception` in jinja2 or transformers can swallow it."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _RenderGuard:
    """The tracer of one render: deadline and output bound.

    NOTE: CPython unsets a tracer that raises, so it stops the render once;
    the render's own code never sees a second chance to catch it."""

    def __init__(self, timeout_s: float, max_chars: int) -> None:
        self.deadline = time.monotonic() + timeout_s
        self.max_chars = max_chars
        self.num_chars = 0

    def on_call(self, frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > self.deadline:
            raise _RenderStopped("timeout")
        # Line events only in template code: library code stays at full speed.
        return self.on_template_event if frame.f_code.co_filename == TEMPLATE_FILENAME else None

    def on_template_event(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "line":
            if time.monotonic() > self.deadline:
                raise _RenderStopped("timeout")
        elif event == "return" and isinstance(arg, str):
            # A generator's `return` event fires at every yield, with the piece.
            if frame.f_code.co_name == TEMPLATE_ROOT_FUNCTION:
                self.num_chars += len(arg)
                too_long = self.num_chars > self.max_chars
            else:  # a macro returning its whole output at once
                too_long = len(arg) > self.max_chars
            if too_long:
                raise _RenderStopped("too_long")
        return self.on_template_event


def check_chat_template_kwargs(template_kwargs: dict[str, Any], field: str = "chat_template_kwargs") -> None:
    """Refuse keys that would override the renderer's own arguments."""
    clashing = sorted(set(template_kwargs) & RENDERER_ARGUMENTS)
    if clashing:
        raise InvalidRequestError(
            f"{field}.{clashing[0]}", template_kwargs[clashing[0]],
            "is set by the server itself; chat_template_kwargs may not contain "
            + ", ".join(sorted(RENDERER_ARGUMENTS)),
        )


def render_chat_template(
    tokenizer: Any,
    conversation: list[dict[str, Any]],
    *,
    chat_template: str | None,
    add_generation_prompt: bool,
    template_kwargs: dict[str, Any] | None,
    timeout_s: float,
    max_chars: int,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """`tokenizer.apply_chat_template(..., tools=tools, tokenize=False)` stopped past
    `timeout_s` or `max_chars` (InvalidRequestError naming the template's
    field and the limit). Blocking: call it in a worker thread.

    Other template failures (a jinja error, a tokenizer without a template)
    raise as they are."""
    field = "chat_template" if chat_template is not None else "messages"
    guard = _RenderGuard(timeout_s, max_chars)
    previous_tracer = sys.gettrace()
    sys.settrace(guard.on_call)
    try:
        text = tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            tokenize=False, tools=tools, **(template_kwargs or {}),
        )
    except _RenderStopped as stopped:
        raise _limit_error(stopped.reason, field, chat_template, timeout_s, max_chars) from None
    finally:
        sys.settrace(previous_tracer)
    if len(text) > max_chars:  # a template the tracer could not see (not jinja2 source)
        raise _limit_error("too_long", field, chat_template, timeout_s, max_chars)
    return str(text)


def _limit_error(
    reason: str, field: str, chat_template: str | None, timeout_s: float, max_chars: int
) -> InvalidRequestError:
    value = f"<{len(chat_template)} characters>" if chat_template is not None else "<the model's chat template>"
    if reason == "timeout":
        limit = f"rendering the chat template took longer than server.chat_template_timeout_s = {timeout_s} s"
    else:
        limit = f"the chat template rendered more than {max_chars} characters"
    return InvalidRequestError(field, value, limit)
