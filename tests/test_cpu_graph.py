"""CPU decode graphs (platforms/cpu/graph.py): a recorded forward replays its
C kernels and ATen operations on whatever its inputs hold at replay time,
refuses what it cannot replay, and in the engine gives the eager tokens."""

from __future__ import annotations

import ast
import ctypes
import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from test_async_scheduling_e2e import ENGINE_KWARGS, _generate

from pagedllm import LLM, SamplingParams
from pagedllm.core.errors import GraphCaptureError
from pagedllm.platforms.cpu import fused_ops as cpu_ops
from pagedllm.platforms.cpu.graph import CpuGraph, kernel_call, refuse_capture

needs_kernels = pytest.mark.skipif(cpu_ops.load() is None, reason="no C compiler for the CPU kernels")


def _layer_like(x: torch.Tensor, weight: torch.Tensor, table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """A gather, a functional op, an in-place op, views and a C kernel."""
    h = torch.nn.functional.embedding(ids, table) + x  # functional
    h.mul_(0.5)  # in place
    h[:, 0] = ids.to(h.dtype)  # `to` is a "view" op that copies here
    gate_up = torch.cat([h, h.t().reshape(h.shape) * 2], dim=-1).view(h.shape[0], -1)  # reshape copies too
    out = cpu_ops.silu_and_mul(gate_up)
    assert out is not None
    normed = cpu_ops.rms_norm(out, None, weight, 1e-6)
    assert isinstance(normed, torch.Tensor)
    return normed[:, 1:]  # a view of the kernel's output


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()  # as the model runner runs: `to` and `reshape` reach the recorder undecomposed
def test_a_replay_computes_the_forward_of_the_inputs_it_finds(dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(5, 24, generator=generator).to(dtype)
    weight = torch.randn(24, generator=generator).to(dtype)
    table = torch.randn(50, 24, generator=generator).to(dtype)
    ids = torch.tensor([3, 1, 4, 1, 5])
    graph = CpuGraph.capture(lambda: _layer_like(x, weight, table, ids))
    gc.collect()  # the graph, not the caller, keeps its temporaries alive
    assert graph.output is not None and graph.activation_bytes > 0
    for step in range(3):
        x.copy_(torch.randn(5, 24, generator=generator).to(dtype))
        ids.copy_(torch.randint(0, 50, (5,), generator=generator))
        graph.replay()
        expected = _layer_like(x.clone(), weight, table, ids.clone())
        assert torch.equal(graph.output, expected), step


def test_a_forward_that_reads_a_value_on_the_host_is_refused() -> None:
    x = torch.ones(4)

    def branches_on_data() -> torch.Tensor:
        return x * 2 if bool(x.sum() > 0) else x

    with pytest.raises(GraphCaptureError, match="host value"):
        CpuGraph.capture(branches_on_data)


def test_a_forward_that_draws_random_numbers_is_refused() -> None:
    x = torch.ones(4)
    with pytest.raises(GraphCaptureError, match="random"):
        CpuGraph.capture(lambda: x + torch.rand(4))


@torch.inference_mode()
def test_eval_mode_dropout_is_replayed_as_the_identity_and_training_dropout_refused() -> None:
    # transformers' modeling code calls dropout in every layer, in eval mode too.
    x = torch.ones(4)
    graph = CpuGraph.capture(lambda: torch.nn.functional.dropout(x * 2, p=0.1, training=False) + 1)
    x.fill_(5.0)
    graph.replay()
    assert graph.output is not None and graph.output.tolist() == [11.0] * 4
    with pytest.raises(GraphCaptureError, match="random"):
        CpuGraph.capture(lambda: torch.nn.functional.dropout(x * 2, p=0.1, training=True))


def test_a_computation_outside_both_recorders_fails_the_capture_check() -> None:
    """A write through numpy is neither an ATen op nor a kernel_call: its
    result is missing from the replay, and the poisoned check sees it."""
    x = torch.ones(4)

    def writes_through_numpy() -> torch.Tensor:
        out = x * 2
        out.numpy()[:] += 1.0
        return out

    with pytest.raises(GraphCaptureError, match="did not reproduce"):
        CpuGraph.capture(writes_through_numpy)


def test_a_bypassed_write_into_persistent_state_passes_the_capture_check() -> None:
    """What the capture check does not cover (graph.py's NOTE): a write
    into a tensor the forward did not create (the KV cache) that bypassed
    both recorders leaves the recorded run's value in place, so the check
    passes, and a replay silently skips the write."""
    cache, x = torch.zeros(4), torch.ones(4)

    def writes_the_cache_through_numpy() -> torch.Tensor:
        cache.numpy()[:] = x.numpy() * 3
        return cache * 2

    graph = CpuGraph.capture(writes_the_cache_through_numpy)
    x.fill_(5.0)
    graph.replay()
    assert graph.output is not None and graph.output.tolist() == [6.0] * 4  # stale: 3 * 1, not 3 * 5


def test_a_c_call_through_kernel_call_replays_its_write_into_persistent_state() -> None:
    cache = torch.ones(4)

    def clears_the_cache() -> torch.Tensor:
        kernel_call(ctypes.memset, cache, 0, cache.nbytes)
        return cache + 1

    graph = CpuGraph.capture(clears_the_cache)
    cache.fill_(7.0)
    graph.replay()
    assert graph.output is not None and graph.output.tolist() == [1.0] * 4


# Every C kernel a forward may run goes through kernel_call, the only way a
# CPU graph records it (above: the capture check cannot see a bypassed write
# into the KV cache). A kernel wrapper is a package module that loads a
# library with kernel_build.load_library; its library's functions may be
# called directly only where no forward runs:
LIBRARY_LOADERS = {"load", "_library", "load_library"}
SETUP_CALLS = {
    # Declares the signatures and probes availability, once per process.
    "load",
    # Packs a weight into the AMX tile layout when a layer is bound to its
    # GEMM (ops.py), before any forward.
    "platforms/cpu/amx_linear.py:_pack",
}
KERNEL_WRAPPERS = {"platforms/cpu/fused_ops.py", "platforms/cpu/amx_linear.py", "platforms/cpu/fused_moe.py",
                   "platforms/cpu/grouped_linear.py",
                   "attention_backends/cpu_decode_kernel.py", "attention_backends/cpu_prefill_kernel.py"}


def _is_loader_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    return (isinstance(func, ast.Name) and func.id in LIBRARY_LOADERS) or (
        isinstance(func, ast.Attribute) and func.attr in LIBRARY_LOADERS)


def _calls_a_library_function(func: ast.AST, libraries: set[str]) -> bool:
    if isinstance(func, ast.Attribute):  # library.kernel(...), load().kernel(...)
        return (isinstance(func.value, ast.Name) and func.value.id in libraries) or _is_loader_call(func.value)
    return (  # getattr(library, name)(...)
        isinstance(func, ast.Call) and isinstance(func.func, ast.Name) and func.func.id == "getattr"
        and bool(func.args) and isinstance(func.args[0], ast.Name) and func.args[0].id in libraries
    )


def direct_library_calls(source: str) -> list[tuple[str, str]]:
    """(function, call) for each call of a loaded library's function in
    `source` that is not made through kernel_call, per top-level function."""
    found = []
    for function in ast.parse(source).body:
        if not isinstance(function, ast.FunctionDef):
            continue
        nodes = list(ast.walk(function))
        libraries = {"library"} | {target.id for node in nodes if isinstance(node, ast.Assign)
                                   and _is_loader_call(node.value) for target in node.targets
                                   if isinstance(target, ast.Name)}
        found += [(function.name, f"line {node.lineno}: {ast.unparse(node.func)}(...)") for node in nodes
                  if isinstance(node, ast.Call) and _calls_a_library_function(node.func, libraries)]
    return found


def test_the_kernel_call_guard_finds_a_planted_bypass() -> None:
    planted = (
        "def silu_and_mul(gate_up):\n"
        "    library = _library()\n"
        "    library.silu_and_mul(gate_up.data_ptr())\n"
        "    lib = cpu_ops.load()\n"
        "    getattr(lib, 'rms_norm')(0)\n"
        "    load().rotary_embedding(0)\n"
        "    kernel_call(library.silu_and_mul, gate_up)\n"
    )
    assert direct_library_calls(planted) == [
        ("silu_and_mul", "line 3: library.silu_and_mul(...)"),
        ("silu_and_mul", "line 5: getattr(lib, 'rms_norm')(...)"),
        ("silu_and_mul", "line 6: load().rotary_embedding(...)"),
    ]


def test_no_kernel_wrapper_calls_a_c_kernel_outside_kernel_call() -> None:
    root = Path(__file__).resolve().parent.parent
    wrappers = {}
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if not relative.startswith(("tests/", "examples/", "benchmarks/", ".")) and "load_library(" in (
                source := path.read_text()) and relative != "platforms/cpu/kernel_build.py":
            wrappers[relative] = source
    assert set(wrappers) >= KERNEL_WRAPPERS  # the scan reads the wrappers it must
    bypasses = {relative: [call for function, call in direct_library_calls(source)
                           if function not in SETUP_CALLS and f"{relative}:{function}" not in SETUP_CALLS]
                for relative, source in wrappers.items()}
    assert {relative: calls for relative, calls in bypasses.items() if calls} == {}


def test_refuse_capture_raises_only_while_capturing() -> None:
    refuse_capture("not capturing: nothing happens")

    def refuses() -> torch.Tensor:
        refuse_capture("this path indexes with host values")
        return torch.zeros(1)

    with pytest.raises(GraphCaptureError, match="host values"):
        CpuGraph.capture(refuses)


def test_a_forward_whose_output_holds_nan_is_still_captured() -> None:
    """The capture check compares bits: a NaN the forward really computes
    is reproduced, not a mismatch."""
    x = torch.tensor([1.0, 0.0, -1.0])
    graph = CpuGraph.capture(lambda: x / x)  # 0 / 0 = NaN in the middle
    x.copy_(torch.tensor([0.0, 2.0, 0.0]))
    graph.replay()
    assert graph.output is not None and graph.output.isnan().tolist() == [True, False, True]


def test_recording_belongs_to_the_capturing_thread() -> None:
    """Another thread's kernels and host reads during a capture are its own."""
    import threading

    raised: list[bool] = []

    def other_thread() -> None:
        try:
            refuse_capture("not the capturing thread")
            raised.append(False)
        except GraphCaptureError:
            raised.append(True)

    def run() -> torch.Tensor:
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        return torch.ones(2) * 3

    CpuGraph.capture(run)
    assert raised == [False, False]  # the warm-up run and the recorded one


# ---- in the engine ----------------------------------------------------------


def _graph_runner(llm: LLM) -> Any:
    return llm.engine_core.engine_core.model_executor.driver_worker.model_runner.graph_runner  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def eager_tokens() -> list[list[int]]:
    return _generate(LLM(**ENGINE_KWARGS, enforce_eager=True))


@pytest.mark.slow
def test_decode_graphs_give_the_eager_tokens_with_hits_preemption_and_grammars(
    eager_tokens: list[list[int]],
) -> None:
    """Batches that shrink (replays padded to a captured size), preempt, hit
    the prefix cache, cross block boundaries and follow JSON schemas."""
    llm = LLM(**ENGINE_KWARGS)
    runner = _graph_runner(llm)
    assert runner is not None and runner.sizes_for(1) == [1, 2, 4, 8]
    assert _generate(llm) == eager_tokens
    core = llm.engine_core.engine_core  # type: ignore[attr-defined]
    assert core.scheduler.num_preemptions > 0 and core.kv_cache_manager.total_prefix_cache_hits > 0
    assert runner.num_replays > 50


@pytest.mark.slow
def test_decode_graphs_with_async_scheduling_and_with_drafts(eager_tokens: list[list[int]]) -> None:
    """Async scheduling replays too; so do a drafter's verify steps in which
    every request scores the same 1 + j tokens (j = 1..k drafts)."""
    llm = LLM(**ENGINE_KWARGS, async_scheduling=True)
    assert _generate(llm) == eager_tokens and _graph_runner(llm).num_replays > 50
    speculative = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                   "policy": "always"}
    llm = LLM(**ENGINE_KWARGS, speculative_config=speculative)
    runner = _graph_runner(llm)
    # Every decode graph size at every q (q x size tokens fit MAX_VERIFY_GRAPH_TOKENS); each captured when first needed.
    assert [runner.allowed_sizes[q] for q in (2, 3, 4)] == [[1, 2, 4, 8]] * 3
    assert [runner.sizes_for(q) for q in (2, 3, 4)] == [[], [], []]
    # Requests with drafts of different lengths (some none) replay padded graphs.
    assert _generate(llm) == eager_tokens and runner.num_padded_replays > 0
    # One request at a time: every verify step is uniform.
    prompt = "one two three four one two three four one two three four one two"
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    eager = LLM(**ENGINE_KWARGS, enforce_eager=True).generate([prompt], params)[0].outputs[0].token_ids
    before = sum(count for q, count in runner.num_replays_by_query_len.items() if q > 1)
    assert llm.generate([prompt], params)[0].outputs[0].token_ids == eager
    assert sum(count for q, count in runner.num_replays_by_query_len.items() if q > 1) > before


@pytest.mark.slow
@pytest.mark.parametrize("method,model", [("eagle", "tiny-eagle"), ("draft_model", "tiny-draft")])
def test_model_drafters_replay_their_draft_steps_with_the_eager_tokens(method: str, model: str) -> None:
    """The k - 1 single-token draft steps of a model drafter replay graphs
    per batch size; the tokens are the eager engine's."""
    speculative = {"method": method, "model": model, "num_speculative_tokens": 3, "policy": "always"}
    prompt = "one two three four one two three four one two three four one two"
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    eager = LLM(**ENGINE_KWARGS, speculative_config=speculative, enforce_eager=True)
    llm = LLM(**ENGINE_KWARGS, speculative_config=speculative)
    graphs = _graph_runner(llm)  # the target's
    drafter = llm.engine_core.engine_core.model_executor.driver_worker.model_runner.drafter  # type: ignore[attr-defined]
    assert drafter.draft_graphs is not None and drafter.draft_graphs.allowed_sizes[1] == graphs.sizes_for(1)
    # One prompt alone runs batch-1 draft steps; two admitted together start
    # with batch-2 ones (which of them finishes first is timing, not asserted).
    for prompts in ([prompt], [prompt, prompt[4:]]):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == [
            o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    assert drafter.draft_graphs.num_replays > 0 and drafter.draft_graphs.sizes_for(1) == [1, 2]


@pytest.mark.slow
def test_bfloat16_decode_graphs_give_the_eager_tokens() -> None:
    kwargs = {**ENGINE_KWARGS, "dtype": "bfloat16"}
    eager = _generate(LLM(**kwargs, enforce_eager=True))
    llm = LLM(**kwargs)
    assert _generate(llm) == eager and _graph_runner(llm).num_replays > 50


def test_a_layer_off_the_decode_kernel_refuses_capture_and_the_engine_runs_eagerly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """Without the decode kernel torch_native gathers with host indices:
    capture is refused, logged, and every step runs eagerly."""
    from pagedllm.attention_backends import cpu_decode_kernel

    monkeypatch.setattr(cpu_decode_kernel, "supports", lambda *args: False)
    llm = LLM(model="tiny", dtype="float32", num_kv_blocks=16, max_num_seqs=2)
    assert _graph_runner(llm) is None
    assert "decode graphs: off" in caplog.text and "host-side indices" in caplog.text


def test_recording_does_not_import_dynamo() -> None:
    """torch's dispatch modes guard themselves with Dynamo by default, and the
    first guarded call imports torch._dynamo: 0.9 s of a server's cold start."""
    import subprocess
    import sys

    code = ("import sys, torch\nfrom pagedllm.platforms.cpu.graph import CpuGraph\nx = torch.ones(3)\n"
            "CpuGraph.capture(lambda: x * 2)\nprint('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"


def test_verify_graphs_cover_every_decode_size_up_to_a_token_bound() -> None:
    """Verify steps of 1 + k tokens replay at every decode graph's batch
    size while q x size fits MAX_VERIFY_GRAPH_TOKENS (batch 32 at q = 5:
    160 tokens); larger ones run eagerly."""
    from pagedllm.attention_backends.torch_native import TorchNativeBackend
    from pagedllm.model_registry.batch_graphs import MAX_VERIFY_GRAPH_TOKENS, BatchGraphs
    from pagedllm.platforms.cpu.platform import CpuPlatform

    def graphs(sizes: list[int]) -> BatchGraphs:
        return BatchGraphs(lambda *args: (torch.zeros(1),), TorchNativeBackend, CpuPlatform(), sizes=sizes,
                           max_model_len=64, block_size=16, device=torch.device("cpu"), query_lens=[1, 3, 5])

    assert MAX_VERIFY_GRAPH_TOKENS == 512
    assert graphs([1, 2, 4, 8, 16, 32]).allowed_sizes == {q: [1, 2, 4, 8, 16, 32] for q in (1, 3, 5)}
    big = graphs([1, 64, 128, 256])
    assert big.allowed_sizes == {1: [1, 64, 128, 256], 3: [1, 64, 128], 5: [1, 64]}
    assert big.input_ids.numel() == 3 * 128  # the largest graph's tokens
