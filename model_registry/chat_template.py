"""Which chat template a model's conversations render with: the operator's
(`--chat-template`, `LLM(chat_template=...)`) or the tokenizer's own.

The operator's value is a file or the Jinja text itself, as vLLM reads it: an
existing file is read; a value with none of Jinja's `{`, `}` or a newline
looks like a path, so a missing file is an error rather than a template that
renders the path's characters; anything else is the template.
"""

from __future__ import annotations

import codecs
from pathlib import Path
from typing import Any

from pagedllm.core.errors import ConfigError, InvalidRequestError

# A template has at least one of these; a path has none.
JINJA_CHARS = frozenset("{}\n")


def load_chat_template(value: str | None, field: str = "server.chat_template") -> str | None:
    """The template text of `value` (None stays None); a ConfigError naming
    `field` for a path that cannot be read."""
    if value is None:
        return None
    path = Path(value)
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(field, value, f"a readable UTF-8 template file ({exc})") from None
    if not JINJA_CHARS & set(value):
        raise ConfigError(field, value, "an existing file, or the Jinja template itself (this looks like a path)")
    # As vLLM: a template given inline may write its newlines as `\n`.
    return codecs.decode(value, "unicode_escape") if "\\" in value else value


def has_own_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


class MissingChatTemplateError(InvalidRequestError):
    """A conversation to render, and neither the operator nor the tokenizer
    gives a chat template (transformers has no default one since 4.44)."""

    def __init__(self, how_to_pass: str) -> None:
        super().__init__(
            "chat_template", None,
            f"a chat template: this model's tokenizer has none, so pass one with {how_to_pass}",
        )
