"""pagedllm-example-model: registers GPT-2 (``GPT2LMHeadModel``).

The entry point names this module; it only names the model class as a
"module:Attr" string, so torch and ``gpt2.py`` are imported only when a
checkpoint whose config.json says ``"architectures": ["GPT2LMHeadModel"]``
is loaded.
"""

from __future__ import annotations

from pagedllm.plugins import RegisterFn, hookimpl

# The plugin API range this plugin was written for (pagedllm.plugins.API_VERSION).
PAGEDLLM_API_VERSION = ">=1.0,<2"

ARCHITECTURE = "GPT2LMHeadModel"


@hookimpl
def register_models(register: RegisterFn) -> None:
    register(ARCHITECTURE, "pagedllm_example_model.gpt2:GPT2LMHeadModel")
