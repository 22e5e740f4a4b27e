"""pagedllm-example-drafter: registers the ``suffix_window`` drafter.

This module is what the entry point names, so pagedllm imports it at start-up
in every process. NOTE: it must stay cheap — the drafter class is named as a
"module:Attr" string and imported only when ``speculative.method`` selects it.
"""

from __future__ import annotations

from pagedllm.plugins import RegisterFn, hookimpl

# The plugin API range this plugin was written for (pagedllm.plugins.API_VERSION).
PAGEDLLM_API_VERSION = ">=1.0,<2"

DRAFTER_NAME = "suffix_window"


@hookimpl
def register_drafters(register: RegisterFn) -> None:
    register(DRAFTER_NAME, "pagedllm_example_drafter.drafter:SuffixWindowDrafter", needs_model=False)
