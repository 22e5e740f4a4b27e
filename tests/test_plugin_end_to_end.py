"""Plugins end to end: a backend and a model architecture that only a plugin
registers are what `LLM` actually runs.

Two ways in: a plugin object registered in a fixture with
`get_plugin_manager().register(...)`, and the installed test distribution
`pagedllm-test-plugin` found through its `pagedllm.plugins` entry point.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.attention_backends.base import AttentionImpl
from pagedllm.attention_backends.torch_native import TorchNativeAttentionImpl, TorchNativeBackend
from pagedllm.core.errors import UnknownComponentError
from pagedllm.model_registry.models.llama import LlamaForCausalLM
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl

PLUGIN_NAME = "counting-plugin"
BACKEND_NAME = "counting_native"
ARCHITECTURE = "CountingLlamaForCausalLM"
NUM_KV_BLOCKS = 256


class CountingAttentionImpl(TorchNativeAttentionImpl):
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        CountingBackend.num_forward_calls += 1
        return super().forward(*args, **kwargs)


class CountingBackend(TorchNativeBackend):
    """torch_native attention that counts its forward calls."""

    name = BACKEND_NAME
    num_forward_calls: ClassVar[int] = 0

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CountingAttentionImpl


class CountingLlamaForCausalLM(LlamaForCausalLM):
    """The built-in Llama graph under an architecture name only this plugin knows."""


class CountingPlugin:
    def __init__(self, backend_metadata: dict[str, Any]) -> None:
        self.backend_metadata = backend_metadata

    @hookimpl
    def register_attention_backends(self, register: RegisterFn) -> None:
        register(BACKEND_NAME, CountingBackend, **self.backend_metadata)

    @hookimpl
    def register_models(self, register: RegisterFn) -> None:
        register(ARCHITECTURE, CountingLlamaForCausalLM)


@pytest.fixture
def counting_plugin() -> Iterator[CountingPlugin]:
    pm = get_plugin_manager()
    # The same capability metadata as the built-in torch_native.
    builtin = pm.registry("attention_backend").get("torch_native")
    assert builtin.source == "builtin"
    plugin = CountingPlugin(dict(builtin.metadata))
    pm.register(plugin, name=PLUGIN_NAME)
    CountingBackend.num_forward_calls = 0
    try:
        yield plugin
    finally:
        pm.unregister(name=PLUGIN_NAME)


def _llama_path() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=1234)


def _checkpoint_with_architecture(tmp_path: Path, architecture: str) -> Path:
    """The tiny Llama's weights and tokenizer, with config.json naming `architecture`.

    NOTE: build_tiny_model(..., architectures=[...]) cannot do this: HF's
    save_pretrained rewrites `architectures` to the saving class's name.
    """
    path = tmp_path / architecture
    shutil.copytree(_llama_path(), path)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = [architecture]
    config_file.write_text(json.dumps(config))
    return path


PROMPTS = ["def main():", "import os\nimport sys", "The quick brown fox"]


def _greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _token_ids(outputs: list) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in outputs]


def test_plugin_backend_and_model_are_what_llm_runs(counting_plugin: CountingPlugin, tmp_path: Path) -> None:
    path = _checkpoint_with_architecture(tmp_path, ARCHITECTURE)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, attention_backend=BACKEND_NAME)
    runner = llm.engine_core.engine_core.model_executor.driver_worker
    assert llm.engine_core.ready.attention_backend == BACKEND_NAME
    assert runner.attn_backend is CountingBackend
    assert type(runner.model) is CountingLlamaForCausalLM

    outputs = llm.generate(PROMPTS, _greedy(), use_tqdm=False)
    assert CountingBackend.num_forward_calls > 0

    # Same weights through the built-in architecture and backend: same tokens.
    plain = LLM(model=str(_llama_path()), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    assert plain.engine_core.ready.attention_backend == "cpu"
    assert type(plain.engine_core.engine_core.model_executor.driver_worker.model) is LlamaForCausalLM
    calls_before_plain = CountingBackend.num_forward_calls
    assert _token_ids(outputs) == _token_ids(plain.generate(PROMPTS, _greedy(), use_tqdm=False))
    assert CountingBackend.num_forward_calls == calls_before_plain  # the plain engine never used it


def test_plugin_backend_is_auto_selected_only_when_named(counting_plugin: CountingPlugin) -> None:
    # Registered with torch_native's metadata, but auto selection follows the
    # platform's own priority list.
    llm = LLM(model=str(_llama_path()), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    assert llm.engine_core.ready.attention_backend == "cpu"


def test_architecture_unknown_without_the_plugin(tmp_path: Path) -> None:
    path = _checkpoint_with_architecture(tmp_path, ARCHITECTURE)
    with pytest.raises(UnknownComponentError, match=ARCHITECTURE) as excinfo:
        LLM(model=str(path), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    assert (excinfo.value.kind, excinfo.value.name) == ("model", ARCHITECTURE)


def test_installed_test_distribution_backend_and_model_are_usable(tmp_path: Path) -> None:
    from pagedllm_test_plugin.backend import TestEchoBackend
    from pagedllm_test_plugin.model import TestEchoForCausalLM

    pm = get_plugin_manager()
    source = f"pagedllm-test-plugin {importlib.metadata.version('pagedllm-test-plugin')}"
    path = _checkpoint_with_architecture(tmp_path, "TestEchoForCausalLM")
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, attention_backend="test_echo")
    assert pm.registry("attention_backend").get("test_echo").source == source
    assert pm.registry("model").get("TestEchoForCausalLM").source == source
    core = llm.engine_core.engine_core
    runner = core.model_executor.driver_worker
    assert runner.attn_backend is TestEchoBackend
    assert type(runner.model) is TestEchoForCausalLM

    calls_before = TestEchoBackend.num_forward_calls
    outputs = llm.generate(PROMPTS, _greedy(5), use_tqdm=False)
    assert TestEchoBackend.num_forward_calls > calls_before
    for output in outputs:
        completion = output.outputs[0]
        assert len(completion.token_ids) == 5
        assert completion.finish_reason == "length"
        assert all(0 <= token_id < len(llm.get_tokenizer()) for token_id in completion.token_ids)
    assert core.kv_cache_manager.num_free_blocks == NUM_KV_BLOCKS
