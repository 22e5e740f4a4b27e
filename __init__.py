"""pagedllm: an LLM serving engine with a paged KV cache, built as a plugin platform."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.engine.llm import LLM
    from pagedllm.engine.outputs import CompletionOutput, RequestOutput
    from pagedllm.lora.request import LoRARequest

# Lazy so that `import pagedllm.plugins` (done by every plugin) stays cheap.
_EXPORTS = {
    "LLM": "pagedllm.engine.llm",
    "SamplingParams": "pagedllm.core.sampling_params",
    "EngineConfig": "pagedllm.core.config",
    "RequestOutput": "pagedllm.engine.outputs",
    "CompletionOutput": "pagedllm.engine.outputs",
    "LoRARequest": "pagedllm.lora.request",
}

__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "LoRARequest", "RequestOutput", "SamplingParams", "__version__",
]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
