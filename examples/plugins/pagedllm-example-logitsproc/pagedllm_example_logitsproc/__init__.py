"""pagedllm-example-logitsproc: registers the ``no_repeat_ngram`` logits processor.

This module is what the entry point names, so pagedllm imports it at start-up
in every process. NOTE: it must stay cheap — the processor class is named as
a "module:Attr" string and imported only when an engine loads it.
"""

from __future__ import annotations

from pagedllm.plugins import RegisterFn, hookimpl

# The plugin API range this plugin was written for (pagedllm.plugins.API_VERSION).
PAGEDLLM_API_VERSION = ">=1.6,<2"

PROCESSOR_NAME = "no_repeat_ngram"
ARG = "no_repeat_ngram_size"


@hookimpl
def register_logits_processors(register: RegisterFn) -> None:
    register(PROCESSOR_NAME, "pagedllm_example_logitsproc.processor:NoRepeatNGramLogitsProcessor", args=[ARG])
