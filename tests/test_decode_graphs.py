"""Decode-graph capture and replay, proven on CPU with a stand-in for CUDA
graphs whose replay re-runs the captured function into the captured output
(what a CUDA graph replay does), so the persistent buffers, the padding to a
captured size and the fallbacks are all exercised."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.worker.decode_graphs import default_graph_sizes

PROMPTS = ["def main():\n", "import os\n", "class Stack:\n    def push(self, item):\n"]


def test_default_sizes_are_powers_of_two_up_to_max_num_seqs() -> None:
    assert default_graph_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert default_graph_sizes(6) == [1, 2, 4, 6]
    assert default_graph_sizes(1) == [1]


@pytest.fixture
def fake_graph_capture(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    captured_sizes: list[int] = []

    def capture_graph(self: CpuPlatform, run: Callable[[], torch.Tensor], pool: object | None):
        output = run()
        captured_sizes.append(output.shape[0])
        return (lambda: output.copy_(run())), output, pool

    monkeypatch.setattr(CpuPlatform, "supports_graph_capture", lambda self: True)
    monkeypatch.setattr(CpuPlatform, "capture_graph", capture_graph)
    return captured_sizes


def _greedy(llm: LLM) -> list[list[int]]:
    # Different lengths: the decode batch shrinks 3 -> 2 -> 1 (padded to 4, 2, 1).
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 7, 10)]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_replayed_decode_steps_give_the_eager_tokens(
    fake_graph_capture: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedllm.attention_backends.triton.backend import TritonBackend

    # The stand-in's replay re-runs the interpreted kernels, which a real graph would not record.
    monkeypatch.setattr(TritonBackend, "supports_graph_capture", classmethod(lambda cls, block_size: True))
    common = dict(model="tiny", dtype="float32", num_kv_blocks=32, max_num_seqs=4)
    eager = _greedy(LLM(**common, attention_backend="torch_native", enforce_eager=True))
    llm = LLM(**common, attention_backend="triton", cuda_graph_sizes=[1, 2, 4])
    runner = llm.engine_core.engine_core.model_executor.driver_worker.model_runner.graph_runner
    assert runner is not None and fake_graph_capture == [4, 2, 1]  # largest first
    assert _greedy(llm) == eager
    assert runner.num_replays == 3 + 3 + 3  # decode steps of 3, 2 and 1 running requests


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs the Triton interpreter")
def test_triton_verify_steps_replay_uniform_and_padded_graphs_with_the_eager_tokens(
    fake_graph_capture: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton backend opts into verify graphs (the CUDA path): steps in
    which requests score 1 + k tokens, or different counts padded to the
    longest, replay and give the eager engine's tokens."""
    from pagedllm.attention_backends.triton.backend import TritonBackend

    monkeypatch.setattr(TritonBackend, "supports_graph_capture", classmethod(lambda cls, block_size: True))
    speculative = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
                   "policy": "always"}
    common = dict(model="tiny", dtype="float32", num_kv_blocks=32, max_num_seqs=2)
    prompts = ["a b a b a b a b", "x = 1\ny = 2\n"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    eager = tokens(LLM(**common, attention_backend="torch_native", enforce_eager=True))
    llm = LLM(**common, attention_backend="triton", cuda_graph_sizes=[1, 2], speculative_config=speculative)
    runner = llm.engine_core.engine_core.model_executor.driver_worker.model_runner.graph_runner
    assert tokens(llm) == eager
    assert sum(n for q, n in runner.num_replays_by_query_len.items() if q > 1) > 0
    assert runner.num_padded_replays > 0


def test_enforce_eager_captures_nothing(fake_graph_capture: list[int]) -> None:
    llm = LLM(model="tiny", num_kv_blocks=16, attention_backend="torch_native", enforce_eager=True)
    assert llm.engine_core.engine_core.model_executor.driver_worker.model_runner.graph_runner is None
    assert fake_graph_capture == []


def test_a_backend_that_cannot_be_captured_runs_eagerly(
    fake_graph_capture: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedllm.attention_backends.torch_native import TorchNativeBackend

    monkeypatch.setattr(TorchNativeBackend, "supports_graph_capture", classmethod(lambda cls, block_size: False))
    llm = LLM(model="tiny", num_kv_blocks=16, attention_backend="torch_native")
    assert llm.engine_core.engine_core.model_executor.driver_worker.model_runner.graph_runner is None
    assert fake_graph_capture == []
    (output,) = llm.generate(["x = 1\n"], SamplingParams(temperature=0.0, max_tokens=3), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


def test_cpu_platform_captures_its_decode_graphs_by_default() -> None:
    llm = LLM(model="tiny", num_kv_blocks=16, max_num_seqs=4)
    runner = llm.engine_core.engine_core.model_executor.driver_worker.model_runner.graph_runner
    assert runner is not None and runner.sizes_for(1) == [1, 2, 4]


def test_graph_sizes_from_config_are_validated() -> None:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.errors import ConfigError

    assert EngineConfig.from_flat(graph_sizes="1,2,8").device.graph_sizes == [1, 2, 8]
    with pytest.raises(ConfigError, match="graph_sizes"):
        EngineConfig.from_flat(graph_sizes=[0, 4])


def test_cuda_graph_sizes_is_an_alias_of_graph_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The field sizes CPU graphs too, so it lost "cuda"; vLLM's name, its
    env var and its flag keep working."""
    from pagedllm.core.config import EngineConfig
    from pagedllm.entrypoints.config_flags import add_engine_config_flags, engine_config_overrides

    assert EngineConfig.from_flat(cuda_graph_sizes="1,2,8").device.graph_sizes == [1, 2, 8]
    assert EngineConfig.load(device={"cuda_graph_sizes": [4]}).device.graph_sizes == [4]
    config = EngineConfig.load(device={"graph_sizes": [2]})
    assert config.device.cuda_graph_sizes == [2]
    config.device.cuda_graph_sizes = [3]
    assert config.device.graph_sizes == [3]
    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_engine_config_flags(parser)
    assert engine_config_overrides(parser.parse_args(["--cuda-graph-sizes", "1,16"])) == {
        "device": {"graph_sizes": ["1", "16"]}}  # parsed by the field, as --graph-sizes is
    monkeypatch.setenv("PAGEDLLM_DEVICE__CUDA_GRAPH_SIZES", "[5, 6]")
    assert EngineConfig.load().device.graph_sizes == [5, 6]


def test_compile_outside_attention_keeps_outputs_and_leaves_attention_eager() -> None:
    from pagedllm.worker.compile import compile_outside_attention

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm = LLM(model="tiny", dtype="float32", num_kv_blocks=16)
    expected = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    model = llm.engine_core.engine_core.model_executor.driver_worker.model
    compile_outside_attention(model, backend="eager")  # the compiler itself is torch's business
    assert all(getattr(layer.forward, "_torchdynamo_disable", False) for layer in model.get_attention_layers())
    llm2 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert llm2 == expected
