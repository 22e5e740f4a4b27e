"""Multi-LoRA serving in the engine core: the scheduler's adapter slots and
admission (max_loras, loading adapters, failed ones), the engine core's
adapter store, the step codec carrying slot loads, and the front end's
registration and refusals."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.lora_adapters import peft_greedy, write_peft_adapter
from helpers.scheduler_utils import FakeRunner, prompt
from safetensors.torch import load_file, save_file

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.core.config import EngineConfig, LoRAConfig, SchedulerConfig
from pagedllm.core.errors import InvalidRequestError
from pagedllm.core.kv_cache.hashing import get_hash_fn, get_request_block_hasher
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.lora import LoRARef, LoRASlotLoad
from pagedllm.core.lora_slots import LOADING, LoRASlotTable
from pagedllm.core.request import Request
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.outputs import RequestOutput
from pagedllm.executors.messages import ExecuteModel, WorkerInputDecoder, encode_step
from pagedllm.lora.adapter import LoRAAdapterError
from pagedllm.lora.registry import LoRARegistry
from pagedllm.lora.store import LoRAStore
from pagedllm.routers.cache_mirror import PromptHasher
from pagedllm.testing.checkpoints import config_json, save_random_checkpoint

ADAPTER_A = LoRARef("a", "a" * 64, "/adapters/a")
ADAPTER_B = LoRARef("b", "b" * 64, "/adapters/b")
ADAPTER_C = LoRARef("c", "c" * 64, "/adapters/c")


@dataclass
class FakeStore:
    """A LoRAAdapterStore whose adapters are ready unless `states` says
    otherwise; it counts who holds what."""

    states: dict[str, str | None] = field(default_factory=dict)
    holders: Counter[str] = field(default_factory=Counter)

    def request_load(self, ref: LoRARef) -> None:
        self.holders[ref.digest] += 1

    def release(self, digest: str) -> None:
        self.holders[digest] -= 1

    def state(self, digest: str) -> str | None:
        return self.states.get(digest)

    def weights(self, digest: str) -> dict[str, object]:
        return {"model.layers.0.self_attn.q_proj.lora_A": f"tensor-of-{digest[:1]}"}

    def num_loaded(self) -> int:
        return len(self.holders)

    def take_load_times(self) -> list[float]:
        return []

    def wait_for_loads(self, timeout_s: float) -> None:
        pass

    def shutdown(self) -> None:
        pass


class LoRARunner(FakeRunner):
    """The fake runner, plus the runner's share of LoRA: it applies each
    step's slot loads and checks that every scheduled request's adapter is
    in a slot, and that a step uses at most max_loras adapters."""

    def __init__(self, scheduler: Scheduler, max_loras: int) -> None:
        super().__init__(scheduler)
        self.max_loras = max_loras
        self.slots: dict[int, str] = {}
        self.request_loras: dict[str, LoRARef | None] = {}
        self.loads: list[list[tuple[int, str]]] = []

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.loads.append([(load.slot, load.digest[:1]) for load in scheduler_output.lora_loads])
        for load in scheduler_output.lora_loads:
            assert 1 <= load.slot <= self.max_loras
            self.slots[load.slot] = load.digest
        for new_data in scheduler_output.scheduled_new_reqs:
            self.request_loras[new_data.req_id] = new_data.lora
        step_digests = set()
        for request_id in scheduler_output.num_scheduled_tokens:
            lora = self.request_loras[request_id]
            if lora is not None:
                assert lora.digest in self.slots.values(), f"{request_id}: adapter {lora.name} in no slot"
                step_digests.add(lora.digest)
        assert len(step_digests) <= self.max_loras
        return super().execute(scheduler_output)


def lora_scheduler(
    store: FakeStore | LoRAStore | None, max_loras: int = 2, num_blocks: int = 64, **config: object
) -> Scheduler:
    manager = KVCacheManager(num_blocks, 4, enable_caching=True, debug_checks=True)
    slots = None if store is None else LoRASlotTable(max_loras, store)
    return Scheduler(SchedulerConfig(**config), manager, 256, lora_slots=slots)  # type: ignore[arg-type]


def lora_request(request_id: str, lora: LoRARef | None, start: int, max_tokens: int = 3) -> Request:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Request(request_id, prompt(start, 6), params, eos_token_id=None, lora=lora)


def run_all(runner: LoRARunner, max_steps: int = 100) -> list[dict[str, int]]:
    """Step until nothing is left; each step's scheduled requests (an empty
    step waits for a load, as the engine loop does)."""
    scheduled = []
    slots = runner.scheduler.lora_slots
    for _ in range(max_steps):
        if not runner.scheduler.has_unfinished_requests():
            return scheduled
        scheduled.append(dict(runner.step().scheduled))
        if not scheduled[-1] and slots is not None:
            slots.store.wait_for_loads(1.0)
    raise AssertionError("requests left unfinished")


# ---------------------------------------------------------------- scheduler


def test_a_third_adapter_waits_for_a_slot_while_a_base_request_runs() -> None:
    store = FakeStore()
    scheduler = lora_scheduler(store, max_loras=2)
    runner = LoRARunner(scheduler, max_loras=2)
    for request in (
        lora_request("a", ADAPTER_A, 100, max_tokens=2),
        lora_request("b", ADAPTER_B, 200, max_tokens=4),
        lora_request("c", ADAPTER_C, 300),
        lora_request("base", None, 400),
    ):
        scheduler.add_request(request)
    scheduled = run_all(runner)
    assert list(scheduled[0]) == ["a", "b", "base"]  # c waits: a and b hold both slots
    # a finishes after its 2nd token (step 2); c runs from step 3, in a's slot.
    assert [("c" in step) for step in scheduled[:3]] == [False, False, True]
    assert runner.loads[:3] == [[(1, "a"), (2, "b")], [], [(1, "c")]]
    assert all(len(step) > 0 for step in scheduled)
    # Every request let go of its adapter (slots hold none in the store).
    assert set(store.holders.values()) == {0}


def test_an_adapter_still_loading_waits_without_blocking_a_base_request() -> None:
    store = FakeStore(states={ADAPTER_A.digest: LOADING})
    scheduler = lora_scheduler(store)
    runner = LoRARunner(scheduler, max_loras=2)
    scheduler.add_request(lora_request("a", ADAPTER_A, 100))
    scheduler.add_request(lora_request("base", None, 200))
    assert list(runner.step().scheduled) == ["base"]
    assert list(runner.step().scheduled) == ["base"]
    store.states[ADAPTER_A.digest] = None  # loaded
    step = runner.step()
    assert list(step.scheduled) == ["base", "a"]
    assert step.scheduler_output.lora_loads == [
        LoRASlotLoad(1, ADAPTER_A.digest, store.weights(ADAPTER_A.digest))
    ]
    assert step.scheduler_output.scheduled_new_reqs[0].lora == ADAPTER_A


def test_an_unused_adapter_stays_in_its_slot_until_the_least_recently_used_slot_is_needed() -> None:
    store = FakeStore()
    scheduler = lora_scheduler(store, max_loras=2)
    runner = LoRARunner(scheduler, max_loras=2)
    for request_id, lora, start in (("a1", ADAPTER_A, 100), ("b1", ADAPTER_B, 200), ("a2", ADAPTER_A, 300),
                                    ("c1", ADAPTER_C, 400)):
        scheduler.add_request(lora_request(request_id, lora, start, max_tokens=1))
        run_all(runner)
    # a1 -> slot 1, b1 -> slot 2, a2 finds a in slot 1 (no copy), c1 takes
    # slot 2 (b's: least recently used) and a stays.
    assert [loads for loads in runner.loads if loads] == [[(1, "a")], [(2, "b")], [(2, "c")]]
    assert runner.slots == {1: ADAPTER_A.digest, 2: ADAPTER_C.digest}
    assert set(store.holders.values()) == {0}


def test_a_failed_adapter_finishes_its_request_with_the_error_and_others_run() -> None:
    error = "LoRA adapter 'a' (/adapters/a): its files changed since it was registered"
    store = FakeStore(states={ADAPTER_A.digest: error})
    scheduler = lora_scheduler(store)
    runner = LoRARunner(scheduler, max_loras=2)
    scheduler.add_request(lora_request("a", ADAPTER_A, 100))
    scheduler.add_request(lora_request("b", ADAPTER_B, 200))
    first = runner.step()
    assert list(first.scheduled) == ["b"]
    failed = first.outputs["a"]
    assert (failed.finish_reason, failed.stop_reason, failed.new_token_ids) == ("abort", error, [])
    assert "a" not in scheduler.requests and store.holders[ADAPTER_A.digest] == 0


def test_adapters_keep_their_slots_through_preemption() -> None:
    store = FakeStore()
    # 10 blocks of 4 tokens: three 6-token prompts growing to 16 tokens cannot all stay.
    scheduler = lora_scheduler(store, max_loras=2, num_blocks=10)
    runner = LoRARunner(scheduler, max_loras=2)
    for request_id, lora, start in (("a", ADAPTER_A, 100), ("b", ADAPTER_B, 200), ("base", None, 300)):
        scheduler.add_request(lora_request(request_id, lora, start, max_tokens=10))
    run_all(runner)  # LoRARunner checks every step's adapters are in slots
    assert scheduler.num_preemptions > 0
    assert set(store.holders.values()) == {0}


def test_lora_stats_count_requests_and_tokens_per_adapter_name() -> None:
    store = FakeStore()
    scheduler = lora_scheduler(store, max_loras=1)
    runner = LoRARunner(scheduler, max_loras=1)
    same_files_other_name = LoRARef("a-too", ADAPTER_A.digest, ADAPTER_A.path)
    scheduler.add_request(lora_request("a", ADAPTER_A, 100, max_tokens=2))
    scheduler.add_request(lora_request("a2", same_files_other_name, 200, max_tokens=2))
    scheduler.add_request(lora_request("b", ADAPTER_B, 300, max_tokens=2))
    runner.step()
    stats = scheduler.make_stats().lora_stats
    assert stats is not None
    assert (stats.max_lora, stats.running_lora_adapters, stats.waiting_lora_adapters) == (1, ["a", "a-too"], ["b"])
    assert (stats.requests, stats.prompt_tokens, stats.generation_tokens) == (
        {"a": 1, "a-too": 1, "b": 1}, {"a": 6, "a-too": 6}, {"a": 1, "a-too": 1},
    )
    run_all(runner)
    stats = scheduler.make_stats().lora_stats
    assert stats is not None
    assert (stats.requests, stats.prompt_tokens, stats.generation_tokens) == (
        {}, {"b": 6}, {"a": 1, "a-too": 1, "b": 2},
    )


def test_a_request_with_an_adapter_is_refused_without_enable_lora() -> None:
    scheduler = lora_scheduler(None)
    with pytest.raises(InvalidRequestError, match="enable-lora"):
        scheduler.add_request(lora_request("a", ADAPTER_A, 100))
    assert not scheduler.requests


def test_the_routers_prompt_hashes_name_the_adapters_blocks_as_the_engine_does() -> None:
    hasher = PromptHasher(4, "sha256")
    engine_hasher = get_request_block_hasher(4, get_hash_fn("sha256"))
    for lora in (ADAPTER_A, None):
        request = lora_request("r", lora, 100)  # 6 tokens: one hittable block
        assert hasher(request.prompt_token_ids, None, None if lora is None else lora.digest) == engine_hasher(request)
    assert hasher(prompt(100, 6), None, ADAPTER_A.digest) != hasher(prompt(100, 6), None)


# -------------------------------------------------------------------- store


class FakeLoader:
    """Loads adapters by digest from `files`; `gate` holds loads back."""

    def __init__(self, files: dict[str, str]) -> None:
        self.files = files
        self.gate = threading.Event()
        self.gate.set()
        self.loaded: list[str] = []

    def __call__(self, ref: LoRARef) -> tuple[str, dict[str, torch.Tensor]]:
        self.gate.wait(5)
        self.loaded.append(ref.name)
        return self.files[ref.path], {"m.lora_A": torch.full((1, 2), float(len(self.loaded)))}


def wait_ready(store: LoRAStore, digest: str) -> str | None:
    for _ in range(500):
        state = store.state(digest)
        if state != LOADING:
            return state
        store.wait_for_loads(0.01)
    raise AssertionError("load did not finish")


def test_a_store_of_max_loras_adapters_loads_a_new_one_while_unused_ones_sit_in_every_slot() -> None:
    loader = FakeLoader({ref.path: ref.digest for ref in (ADAPTER_A, ADAPTER_B, ADAPTER_C)})
    store = LoRAStore(LoRAConfig(enable_lora=True, max_loras=2), loader=loader)  # max_cpu_loras = 2
    scheduler = lora_scheduler(store, max_loras=2)
    runner = LoRARunner(scheduler, max_loras=2)
    for request_id, lora, start in (("a", ADAPTER_A, 100), ("b", ADAPTER_B, 200), ("c", ADAPTER_C, 300)):
        scheduler.add_request(lora_request(request_id, lora, start))
    steps = run_all(runner)
    assert [request_id for step in steps for request_id in step if step[request_id] == 6] == ["a", "b", "c"]
    assert loader.loaded == ["a", "b", "c"] and store.num_loaded() == 2
    store.shutdown()


def test_store_fails_an_adapter_whose_files_changed_since_it_was_registered() -> None:
    loader = FakeLoader({ADAPTER_A.path: "f" * 64})
    store = LoRAStore(LoRAConfig(enable_lora=True), loader=loader)
    store.request_load(ADAPTER_A)
    state = wait_ready(store, ADAPTER_A.digest)
    assert state is not None and "'a'" in state and "files changed since it was registered" in state
    store.release(ADAPTER_A.digest)
    # Forgotten once no one holds it: a later request loads it again.
    loader.files[ADAPTER_A.path] = ADAPTER_A.digest
    store.request_load(ADAPTER_A)
    assert wait_ready(store, ADAPTER_A.digest) is None
    assert loader.loaded == ["a", "a"] and len(store.take_load_times()) == 1


def test_store_keeps_held_adapters_and_evicts_the_least_recently_used_free_one() -> None:
    loader = FakeLoader({ref.path: ref.digest for ref in (ADAPTER_A, ADAPTER_B, ADAPTER_C)})
    store = LoRAStore(LoRAConfig(enable_lora=True, max_loras=1, max_cpu_loras=2), loader=loader)
    store.request_load(ADAPTER_A)
    store.request_load(ADAPTER_B)
    assert wait_ready(store, ADAPTER_A.digest) is None and wait_ready(store, ADAPTER_B.digest) is None
    store.request_load(ADAPTER_C)  # both places are held: C waits
    assert store.state(ADAPTER_C.digest) == LOADING and loader.loaded == ["a", "b"]
    store.release(ADAPTER_B.digest)  # b is free: C takes its place
    assert wait_ready(store, ADAPTER_C.digest) is None
    assert store.state(ADAPTER_A.digest) is None and store.state(ADAPTER_B.digest) != LOADING
    assert store.state(ADAPTER_B.digest) is not None  # evicted: no longer held
    assert store.num_loaded() == 2
    store.shutdown()


# -------------------------------------------------------------------- codec


def test_step_codec_carries_lora_weights_to_the_ranks() -> None:
    weights = {
        "model.layers.0.self_attn.q_proj.lora_A": torch.randn(4, 8),
        "model.layers.0.self_attn.q_proj.lora_B": torch.randn(8, 4).to(torch.bfloat16),
    }
    step = SchedulerOutput([], [], {}, 0, lora_loads=[LoRASlotLoad(2, ADAPTER_A.digest, weights)])
    message = WorkerInputDecoder().decode(encode_step(step))
    assert isinstance(message, ExecuteModel)
    (load,) = message.step.lora_loads
    assert (load.slot, load.digest, sorted(load.weights)) == (2, ADAPTER_A.digest, sorted(weights))
    for name, tensor in weights.items():
        assert load.weights[name].dtype == tensor.dtype and torch.equal(load.weights[name], tensor)


def test_step_codec_still_refuses_a_tensor_outside_the_bitmask_and_the_loads() -> None:
    stray = SchedulerOutput([], [], {}, 0, lora_loads=[LoRASlotLoad(1, ADAPTER_A.digest, {})])
    stray.finished_req_ids = {torch.ones(1)}  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="not msgpack data"):
        encode_step(stray)


# --------------------------------------------------------- end to end (LLM)

# Prompts past one 16-token block, so a repeat hits the prefix cache.
E2E_PROMPTS = [[5 + (7 * i + 3 * j) % 200 for j in range(20)] for i in range(2)]
MAX_TOKENS = 5


@pytest.fixture(scope="module")
def base_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_checkpoint(config_json("LlamaForCausalLM"), tmp_path_factory.mktemp("lora-e2e") / "base")


@pytest.fixture(scope="module")
def adapters(base_model: Path) -> dict[str, Path]:
    """Three adapters of different ranks and targets (fused q/k/v and gate/up included)."""
    shapes = {"q_v_down": (4, ["q_proj", "v_proj", "down_proj"]), "attention": (8, ["q_proj", "k_proj", "v_proj",
              "o_proj"]), "gate_up": (2, ["gate_proj", "up_proj"])}
    return {
        name: write_peft_adapter(base_model, base_model.parent / name, rank=rank, target_modules=targets, seed=seed)
        for seed, (name, (rank, targets)) in enumerate(shapes.items(), start=1)
    }


@pytest.fixture(scope="module")
def references(base_model: Path, adapters: dict[str, Path]) -> dict[str | None, list[list[int]]]:
    """transformers + PEFT greedy tokens per adapter (None: the base model), float32."""
    refs: dict[str | None, list[list[int]]] = {None: peft_greedy(base_model, None, E2E_PROMPTS, MAX_TOKENS)}
    for name, path in adapters.items():
        refs[name] = peft_greedy(base_model, path, E2E_PROMPTS, MAX_TOKENS)
    return refs


def lora_llm(base_model: Path, **engine_args: Any) -> LLM:
    args: dict[str, Any] = {"dtype": "float32", "enable_lora": True, "max_loras": 2, "max_lora_rank": 8,
                            "num_kv_blocks": 64, "enforce_eager": True, **engine_args}
    return LLM(str(base_model), **args)


def generate_mixed(
    llm: LLM, adapters: dict[str, Path], names: list[str | None]
) -> tuple[list[list[int]], list[int]]:
    """Every prompt with each of `names` (None: the base model) in ONE
    generate call; the tokens and the cached prompt tokens of each."""
    lora_requests = {name: LoRARequest(name, index + 1, str(path)) for index, (name, path) in
                     enumerate(adapters.items())}
    prompts, loras = [], []
    for name in names:
        for prompt_ids in E2E_PROMPTS:
            prompts.append(prompt_ids)
            loras.append(None if name is None else lora_requests[name])
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
                           use_tqdm=False, lora_request=loras)
    for output, lora in zip(outputs, loras, strict=True):
        assert output.lora_request == lora
    return [output.outputs[0].token_ids for output in outputs], [output.num_cached_tokens for output in outputs]


def expected(references: dict[str | None, list[list[int]]], names: list[str | None]) -> list[list[int]]:
    return [tokens for name in names for tokens in references[name]]


ALL = ["q_v_down", None, "attention", "gate_up"]


def test_three_adapters_and_the_base_in_one_batch_match_peft_with_prefix_hits(
    base_model: Path, adapters: dict[str, Path], references: dict[str | None, list[list[int]]]
) -> None:
    llm = lora_llm(base_model)
    try:
        tokens, cached = generate_mixed(llm, adapters, ALL)
        assert tokens == expected(references, ALL)
        assert references["q_v_down"] != references[None]  # the adapters change the output
        again, cached = generate_mixed(llm, adapters, ALL)
        assert again == tokens and all(count == 16 for count in cached)
    finally:
        llm.shutdown()


def test_adapters_match_peft_through_preemption_and_decode_graphs(
    base_model: Path, adapters: dict[str, Path], references: dict[str | None, list[list[int]]]
) -> None:
    # 11 blocks of 4 tokens: two 20-token prompts fill 10, and both need a
    # 6th block for their 21st position: one is preempted.
    llm = lora_llm(base_model, block_size=4, num_kv_blocks=11, max_model_len=40, enforce_eager=False,
                   enable_prefix_caching=False)
    try:
        tokens, _ = generate_mixed(llm, adapters, ALL)
        stats = llm.get_stats()
        assert stats is not None and stats.num_preemptions > 0
        assert tokens == expected(references, ALL)
    finally:
        llm.shutdown()


def test_adapters_match_peft_under_async_scheduling_with_graphs(
    base_model: Path, adapters: dict[str, Path], references: dict[str | None, list[list[int]]]
) -> None:
    # Step k + 1 is scheduled while step k runs: slot loads must not overtake a step in flight.
    llm = lora_llm(base_model, async_scheduling=True, enforce_eager=False, max_loras=1)
    try:
        tokens, _ = generate_mixed(llm, adapters, ALL)
    finally:
        llm.shutdown()
    assert tokens == expected(references, ALL)


def test_adapters_match_peft_at_tensor_parallel_2(
    base_model: Path, adapters: dict[str, Path], references: dict[str | None, list[list[int]]]
) -> None:
    # The mp executor: the slot loads reach rank 1 through the step codec.
    llm = lora_llm(base_model, tensor_parallel_size=2)
    try:
        tokens, _ = generate_mixed(llm, adapters, ALL)
        assert tokens == expected(references, ALL)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_decoding_keeps_each_adapters_greedy_tokens(
    method: str, base_model: Path, adapters: dict[str, Path], references: dict[str | None, list[list[int]]]
) -> None:
    # The draft model is the base model itself, run without the adapters
    # (docs/lora.md): its drafts are the base's, and verification keeps the adapter's tokens.
    speculative = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 2,
                   **({"model": str(base_model)} if method == "draft_model" else {})}
    llm = lora_llm(base_model, speculative_config=speculative, max_loras=3)
    try:
        tokens, _ = generate_mixed(llm, adapters, ALL)
        stats = llm.get_stats()
        assert stats is not None and stats.spec_decoding_stats is not None
        assert stats.spec_decoding_stats.num_draft_tokens > 0
    finally:
        llm.shutdown()
    assert tokens == expected(references, ALL)


def identity_scenario(
    base_model: Path, adapters: dict[str, Path], folder: Path
) -> list[tuple[str, list[int], int]]:
    """One prompt, in turn: adapter "mine" from `folder`, the same files as
    "other-name", the base model, then "mine" with new weights written to
    `folder`; (what ran, its tokens, its cached prompt tokens) of each."""
    llm = lora_llm(base_model)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    shutil.copytree(adapters["q_v_down"], folder)
    runs = [("q_v_down", LoRARequest("mine", 1, str(folder))), ("q_v_down", LoRARequest("other-name", 2, str(folder))),
            (None, None), ("attention", LoRARequest("mine", 1, str(folder)))]
    results = []
    try:
        for index, (weights, lora) in enumerate(runs):
            if index == 3:  # new weights under the same name and folder
                shutil.rmtree(folder)
                shutil.copytree(adapters["attention"], folder)
            (output,) = llm.generate([E2E_PROMPTS[0]], params, use_tqdm=False, lora_request=lora)
            results.append((str(weights), output.outputs[0].token_ids, output.num_cached_tokens))
    finally:
        llm.shutdown()
    return results


def test_cache_identity_is_the_adapters_content_not_its_name(
    base_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    results = identity_scenario(base_model, adapters, tmp_path / "mine")
    # Two names for the same files share the prefix; the base model never
    # hits the adapter's blocks; new weights under the old name and folder
    # never hit the old weights' blocks.
    assert [cached for _, _, cached in results] == [0, 16, 0, 0]


def test_new_weights_under_an_old_name_give_the_new_adapters_tokens(
    base_model: Path, adapters: dict[str, Path], references: dict[str | None, list[list[int]]], tmp_path: Path
) -> None:
    results = identity_scenario(base_model, adapters, tmp_path / "mine")
    assert [tokens for _, tokens, _ in results] == [
        references["q_v_down"][0], references["q_v_down"][0], references[None][0], references["attention"][0]
    ]


def test_adapter_errors_come_before_the_engine_core(base_model: Path, adapters: dict[str, Path]) -> None:
    params = SamplingParams(max_tokens=2)
    llm = lora_llm(base_model, max_lora_rank=4)
    try:
        with pytest.raises(LoRAAdapterError, match="attention"):  # rank 8 > max_lora_rank 4
            llm.generate([E2E_PROMPTS[0]], params, use_tqdm=False,
                         lora_request=LoRARequest("attention", 1, str(adapters["attention"])))
        with pytest.raises(InvalidRequestError, match="one per prompt"):
            llm.generate([E2E_PROMPTS[0]], params, use_tqdm=False, lora_request=[None, None])
        assert not llm.output_processor.has_unfinished_requests()
    finally:
        llm.shutdown()
    plain = LLM(str(base_model), dtype="float32", num_kv_blocks=64, enforce_eager=True)
    try:
        with pytest.raises(InvalidRequestError, match="enable_lora=True"):
            plain.generate([E2E_PROMPTS[0]], params, use_tqdm=False,
                           lora_request=LoRARequest("q", 1, str(adapters["q_v_down"])))
    finally:
        plain.shutdown()


def with_lm_head(adapter: Path, folder: Path, vocab_size: int) -> Path:
    """A copy of `adapter` that also adapts the LM head: in the checkpoint, but no layer holds slots for it."""
    shutil.copytree(adapter, folder)
    tensors = load_file(folder / "adapter_model.safetensors")
    tensors["base_model.model.lm_head.lora_A.weight"] = torch.randn(2, 64)
    tensors["base_model.model.lm_head.lora_B.weight"] = torch.randn(vocab_size, 2)
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def test_a_module_the_model_holds_no_slots_for_is_refused_up_front_and_in_the_core(
    base_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    vocab_size = json.loads((base_model / "config.json").read_text())["vocab_size"]
    folder = with_lm_head(adapters["gate_up"], tmp_path / "lm_head", vocab_size)
    llm = lora_llm(base_model)
    try:
        with pytest.raises(LoRAAdapterError, match="lm_head"):
            llm.generate([E2E_PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False,
                         lora_request=LoRARequest("head", 1, str(folder)))
        assert llm.lora_registry is not None
        adaptable = llm.engine_core.ready.lora_modules  # the ranks' answer, which the core's store checks too
    finally:
        llm.shutdown()
    assert adaptable is not None and "lm_head" not in adaptable and "model.layers.0.mlp.gate_proj" in adaptable
    store = LoRAStore(LoRAConfig(enable_lora=True, max_lora_rank=8), adaptable_modules=adaptable)
    ref = LoRARef("head", "0" * 64, str(folder))
    store.request_load(ref)
    state = wait_ready(store, ref.digest)
    assert state is not None and "lm_head" in state and "has no such module" in state
    store.shutdown()


def test_shutdown_stops_the_engine_cores_adapter_loader(base_model: Path, adapters: dict[str, Path]) -> None:
    llm = lora_llm(base_model)
    llm.generate([E2E_PROMPTS[0]], SamplingParams(max_tokens=1), use_tqdm=False,
                 lora_request=LoRARequest("q", 1, str(adapters["q_v_down"])))
    assert any(thread.name.startswith("lora-load") for thread in threading.enumerate())
    llm.shutdown()
    for _ in range(100):
        if not any(thread.name.startswith("lora-load") for thread in threading.enumerate()):
            return
        time.sleep(0.05)
    raise AssertionError("the adapter loader thread outlived the engine")


def test_async_llm_runs_a_lora_request_and_counts_it_per_adapter(base_model: Path, adapters: dict[str, Path]) -> None:
    config = EngineConfig.from_flat(model=str(base_model), dtype="float32", num_kv_blocks=64, enforce_eager=True,
                                    enable_lora=True)
    lora = LoRARequest("sql", 1, str(adapters["q_v_down"]))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def run() -> list[RequestOutput]:
        llm = AsyncLLM(config, in_process=True)
        try:
            return [output async for output in llm.generate(E2E_PROMPTS[0], params, "r0", lora_request=lora)]
        finally:
            await llm.get_stats()  # the core's last stats reach the stat loggers
            prometheus = llm.stat_logger.prometheus
            assert prometheus is not None
            labels = {"model_name": llm.model_name, "lora_name": "sql"}
            counts.extend(
                prometheus.registry.get_sample_value(f"pagedllm:lora_{name}_total", labels)
                for name in ("requests", "prompt_tokens", "generation_tokens")
            )
            llm.shutdown()

    counts: list[float | None] = []
    outputs = asyncio.run(run())
    assert all(output.lora_request == lora for output in outputs) and outputs[-1].finished
    assert counts == [1.0, len(E2E_PROMPTS[0]), MAX_TOKENS]


def test_registration_reads_a_folder_again_only_when_its_files_changed(
    base_model: Path, adapters: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pagedllm.lora.adapter as adapter_module

    loads: list[str] = []
    real_load = adapter_module.load_lora_adapter

    def counting_load(path: str, **kwargs: Any) -> Any:
        loads.append(kwargs["name"])
        return real_load(path, **kwargs)

    monkeypatch.setattr(adapter_module, "load_lora_adapter", counting_load)
    registry = LoRARegistry(str(base_model), LoRAConfig(enable_lora=True, max_lora_rank=8))
    folder = tmp_path / "adapter"
    shutil.copytree(adapters["q_v_down"], folder)
    first = registry.ref_for(LoRARequest("a", 1, str(folder)))
    assert registry.ref_for(LoRARequest("b", 2, str(folder))) == LoRARef("b", first.digest, first.path)
    assert loads == ["a"]  # the second name was not hashed again
    shutil.rmtree(folder)
    shutil.copytree(adapters["gate_up"], folder)
    changed = registry.ref_for(LoRARequest("a", 1, str(folder)))
    assert loads == ["a", "a"] and changed.digest != first.digest
    assert changed.digest == real_load(adapters["gate_up"], name="x", max_rank=8, max_bytes=1 << 30).ref.digest


def test_files_changed_after_registration_fail_the_request_in_the_engine_core(
    base_model: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    folder = tmp_path / "changing"
    shutil.copytree(adapters["q_v_down"], folder)
    llm = lora_llm(base_model)
    try:
        lora = LoRARequest("changing", 1, str(folder))
        assert llm.lora_registry is not None
        registered = llm.lora_registry.ref_for(lora)
        shutil.rmtree(folder)  # other weights before the engine core reads them
        shutil.copytree(adapters["gate_up"], folder)
        request_id = llm._add_request(E2E_PROMPTS[0], SamplingParams(max_tokens=2), 0, (lora, registered))
        (output,) = llm._run_engine([request_id], use_tqdm=False)
        completion = output.outputs[0]
        assert (completion.finish_reason, completion.token_ids) == ("abort", [])
        error = completion.stop_reason
        assert isinstance(error, str) and "'changing'" in error and "files changed since it was registered" in error
        # Generating again registers the new files: a new digest, and it runs.
        (again,) = llm.generate([E2E_PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False, lora_request=lora)
        assert again.outputs[0].finish_reason == "length"
    finally:
        llm.shutdown()
