"""A model architecture provided by a plugin: the built-in Llama graph renamed.

A checkpoint whose config.json says ``"architectures": ["TestEchoForCausalLM"]``
resolves to this class only through the plugin registry.
"""

from __future__ import annotations

from pagedllm.model_registry.models.llama import LlamaForCausalLM


class TestEchoForCausalLM(LlamaForCausalLM):
    __test__ = False  # not a pytest test class
