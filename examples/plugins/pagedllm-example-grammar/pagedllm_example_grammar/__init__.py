"""pagedllm-example-grammar: registers the ``guidance`` grammar backend.

This module is what the entry point names, so pagedllm imports it at start-up
in every process. NOTE: it must stay cheap — it names the backend class as a
"module:Attr" string; ``backend.py`` (and llguidance) is imported only when a
config (``structured_output.backend: guidance``) or a request
(``structured_outputs.backend: "guidance"``) selects it.
"""

from __future__ import annotations

from pagedllm.plugins import RegisterFn, hookimpl

# The plugin API range this plugin was written for (pagedllm.plugins.API_VERSION).
PAGEDLLM_API_VERSION = ">=1.0,<2"

BACKEND_NAME = "guidance"


@hookimpl
def register_grammar_backends(register: RegisterFn) -> None:
    register(
        BACKEND_NAME,
        "pagedllm_example_grammar.backend:GuidanceBackend",
        kinds=["json", "json_object", "regex", "choice", "grammar"],
        requires=["llguidance"],
    )
