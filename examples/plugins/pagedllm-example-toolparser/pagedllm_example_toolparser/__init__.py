"""pagedllm-example-toolparser: registers the ``mistral_json`` tool-call parser.

This module is what the entry point names, so pagedllm imports it at
start-up. NOTE: it stays cheap: the parser class is named as a
"module:Attr" string, imported only when ``--tool-call-parser mistral_json``
selects it.
"""

from __future__ import annotations

from pagedllm.plugins import RegisterFn, hookimpl

# The plugin API range this plugin was written for (the tool_parser kind is 1.7).
PAGEDLLM_API_VERSION = ">=1.7,<2"

PARSER_NAME = "mistral_json"


@hookimpl
def register_tool_parsers(register: RegisterFn) -> None:
    register(PARSER_NAME, "pagedllm_example_toolparser.parser:MistralJsonToolParser")
