"""pagedllm-example-attention: registers the ``sdpa`` attention backend.

This module is what the entry point names, so pagedllm imports it at start-up
in every process. NOTE: it must stay cheap — it names the backend class as a
"module:Attr" string; ``sdpa.py`` (and torch) is imported only when a config
selects ``attention_backend: sdpa`` or a platform's priority list reaches it.
"""

from __future__ import annotations

from pagedllm.plugins import RegisterFn, hookimpl

# The plugin API range this plugin was written for (pagedllm.plugins.API_VERSION).
PAGEDLLM_API_VERSION = ">=1.0,<2"

BACKEND_NAME = "sdpa"


@hookimpl
def register_attention_backends(register: RegisterFn) -> None:
    register(
        BACKEND_NAME,
        "pagedllm_example_attention.sdpa:SdpaBackend",
        # The support rules the selector checks without importing the backend.
        device_types=["cpu", "cuda"],
        dtypes=["float32", "float16", "bfloat16"],
        head_size_multiple=8,  # torch's fused SDPA kernels want head_dim % 8 == 0
        max_head_size=256,
        supports_sliding_window=False,  # one causal mask per request, no window
    )
