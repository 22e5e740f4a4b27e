"""The model runner with LoRA slots, through SchedulerOutputs as the
scheduler sends them: slot loads applied before the forward, each request's
adapter named once when it is new, rows of two adapters and of the base in
every step, greedy tokens equal to transformers + PEFT's (float32), with
the CPU platform's layer ops bound as the worker binds them, eagerly and
with CPU decode graphs replayed (captured with the adapter products;
padding rows slot 0). Then a slot changes adapter for new requests while
the base model keeps running.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.lora_adapters import ATTENTION, MLP, write_peft_adapter
from helpers.tiny_models import cached_tiny_model
from test_lora_model import load_adapter, peft_reference
from test_models import hf_model

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.core.lora import LoRARef, LoRASlotLoad
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from pagedllm.lora.model import attach_lora_slots
from pagedllm.model_registry.kv_cache import allocate_kv_caches
from pagedllm.model_registry.loader import load_model
from pagedllm.model_registry.models.llama import LlamaForCausalLM
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.worker.decode_graphs import DecodeGraphRunner
from pagedllm.worker.layer_ops import prepare_layer_ops
from pagedllm.worker.model_runner import ModelRunner

BLOCK_SIZE, MAX_MODEL_LEN, NUM_NEW_TOKENS = 16, 64, 5
# name -> (rank, alpha, target modules, seed)
ADAPTERS = {"a": (4, 8, ("q_proj", "v_proj", "down_proj"), 11), "b": (8, 8, ATTENTION + MLP, 12),
            "c": (2, 4, ("o_proj", "up_proj"), 13)}


def build_runner(path: Path, with_graphs: bool) -> ModelRunner:
    model = load_model(path, model_cls=LlamaForCausalLM, attn_backend=TorchNativeBackend, dtype=torch.float32,
                       device="cpu")
    lora = attach_lora_slots(model, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
    prepare_layer_ops(model, CpuPlatform())  # as the worker binds them: the CPU platform's "lora" kernel
    kv_caches = allocate_kv_caches(model, TorchNativeBackend, num_blocks=32, block_size=BLOCK_SIZE, num_kv_heads=2,
                                   head_size=16, dtype=torch.float32, device=torch.device("cpu"))
    graphs = None
    if with_graphs:
        graphs = DecodeGraphRunner(model, TorchNativeBackend, CpuPlatform(), sizes=[1, 2, 4],
                                   max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE, device=torch.device("cpu"),
                                   lora_state=lora.state)
        graphs.capture()
    return ModelRunner(model, TorchNativeBackend, kv_caches, block_size=BLOCK_SIZE, device=torch.device("cpu"),
                       vocab_size=model.config.vocab_size, max_model_len=MAX_MODEL_LEN, max_num_reqs=4,
                       graph_runner=graphs, lora=lora)


class Requests:
    """The scheduler's part in miniature: whole prompts, then one token a step."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.next_block = 1
        self.finished: set[str] = set()

    def generate(self, requests: list[tuple[str, list[int], LoRARef | None]],
                 loads: list[LoRASlotLoad]) -> dict[str, list[int]]:
        new_reqs = []
        for req_id, prompt, ref in requests:
            num_blocks = -(-(len(prompt) + NUM_NEW_TOKENS) // BLOCK_SIZE)
            block_ids = list(range(self.next_block, self.next_block + num_blocks))
            self.next_block += num_blocks
            new_reqs.append(NewRequestData(req_id, prompt, SamplingParams(temperature=0.0, ignore_eos=True),
                                           block_ids, 0, lora=ref))
        num_scheduled = {req_id: len(prompt) for req_id, prompt, _ in requests}
        step = SchedulerOutput(new_reqs, [], num_scheduled, sum(num_scheduled.values()), lora_loads=loads,
                               finished_req_ids=self.finished)
        tokens = {req_id: [] for req_id, _, _ in requests}
        for i in range(NUM_NEW_TOKENS):
            for req_id, token_ids in self.runner.execute_model(step).sampled_token_ids.items():
                tokens[req_id] += token_ids
            cached = [CachedRequestData(req_id, [], len(prompt) + i) for req_id, prompt, _ in requests]
            step = SchedulerOutput([], cached, {req_id: 1 for req_id, _, _ in requests}, len(requests))
        self.finished = set(tokens)
        return tokens


def peft_greedy(reference: Any, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NUM_NEW_TOKENS):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[LoRARef, dict[str, torch.Tensor], Any]]:
    path = cached_tiny_model("llama")
    found = {}
    for name, (rank, alpha, targets, seed) in ADAPTERS.items():
        adapter_dir = write_peft_adapter(path, tmp_path_factory.mktemp(f"adapter-{name}"), rank=rank, alpha=alpha,
                                         target_modules=targets, seed=seed)
        adapter = load_adapter(path, adapter_dir, name)
        found[name] = (adapter.ref, adapter.weights, peft_reference(path, adapter_dir))
    return found


@pytest.mark.parametrize("with_graphs", [False, True], ids=["eager", "cpu-graphs"])
def test_runner_steps_mix_adapters_and_base_as_peft_does(adapters: dict[str, Any], with_graphs: bool) -> None:
    path = cached_tiny_model("llama")
    runner = build_runner(path, with_graphs)
    requests = Requests(runner)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(512, (length,), generator=gen).tolist() for length in (5, 7, 6, 4, 9, 3)]
    (ref_a, weights_a, peft_a), (ref_b, weights_b, peft_b), (ref_c, weights_c, peft_c) = adapters.values()
    first = requests.generate(
        [("r0", prompts[0], ref_a), ("r1", prompts[1], None), ("r2", prompts[2], ref_b), ("r3", prompts[3], ref_a)],
        [LoRASlotLoad(2, ref_a.digest, weights_a), LoRASlotLoad(1, ref_b.digest, weights_b)],
    )
    assert first == {"r0": peft_greedy(peft_a, prompts[0]), "r1": peft_greedy(hf_model(path), prompts[1]),
                     "r2": peft_greedy(peft_b, prompts[2]), "r3": peft_greedy(peft_a, prompts[3])}
    # Slot 2 changes adapter; b stays in slot 1 unused; a base request beside.
    second = requests.generate([("r4", prompts[4], None), ("r5", prompts[5], ref_c)],
                               [LoRASlotLoad(2, ref_c.digest, weights_c)])
    assert second == {"r4": peft_greedy(hf_model(path), prompts[4]), "r5": peft_greedy(peft_c, prompts[5])}
    assert first["r0"] != peft_greedy(hf_model(path), prompts[0])  # the adapter changed the tokens
    if with_graphs:
        assert runner.graph_runner is not None
        assert runner.graph_runner.num_replays == 2 * (NUM_NEW_TOKENS - 1)  # every decode step replayed


def test_an_engine_with_lora_enabled_serves_the_base_model_as_one_without() -> None:
    """The worker attaches slots to the target (every projection of every
    layer), captures its decode graphs with the adapter products, and base
    requests replay them with the plain engine's tokens; the memory
    profile's forward runs with adapters active."""
    from pagedllm import LLM

    common: dict[str, Any] = dict(model="tiny", dtype="float32", num_kv_blocks=64, max_num_seqs=4)
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 2
    prompts = ["def main():\n", "import os\n"]
    llm = LLM(**common, enable_lora=True, max_loras=2, max_lora_rank=8)
    worker = llm.engine_core.engine_core.model_executor.driver_worker
    num_layers = worker.model.config.num_hidden_layers
    supported = worker.lora_supported_modules()
    assert supported is not None and len(supported) == 7 * num_layers
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert worker.model_runner.graph_runner.num_replays == 5
    worker._profile_run()  # the memory profile's forward, every row in slot 1
    assert worker.lora_slots.state.token_slots is None
    plain = LLM(**common)
    assert tokens == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]


def test_a_padded_verify_graph_replays_each_rows_adapter(adapters: dict[str, Any]) -> None:
    """Requests scoring 3, 1 and 2 tokens (adapter, base, adapter) replay the
    q = 3 graph, each request's rows padded at its end: every row's output
    equals the eager forward's with the same slots."""
    import numpy as np

    from pagedllm.model_registry.input_batch import InputBatch

    model = load_model(cached_tiny_model("llama"), model_cls=LlamaForCausalLM, attn_backend=TorchNativeBackend,
                       dtype=torch.float32, device="cpu")
    lora = attach_lora_slots(model, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
    prepare_layer_ops(model, CpuPlatform())
    allocate_kv_caches(model, TorchNativeBackend, num_blocks=8, block_size=BLOCK_SIZE, num_kv_heads=2, head_size=16,
                       dtype=torch.float32, device=torch.device("cpu"))
    device = torch.device("cpu")
    graphs = DecodeGraphRunner(model, TorchNativeBackend, CpuPlatform(), sizes=[1, 2, 4], max_model_len=MAX_MODEL_LEN,
                               block_size=BLOCK_SIZE, device=device, query_lens=[2, 3], lora_state=lora.state)
    graphs.capture()
    lora.load_slot(1, adapters["a"][1])
    lora.load_slot(2, adapters["b"][1])
    block_table = np.array([[1], [2], [3]], dtype=np.int32)
    gen = torch.Generator().manual_seed(5)

    def eager(batch: InputBatch, request_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        input_ids = torch.randint(512, (batch.num_tokens,), generator=gen)
        slots = torch.tensor(request_slots, dtype=torch.int32).repeat_interleave(torch.from_numpy(batch.query_lens))
        lora.state.token_slots = slots
        with torch.inference_mode():  # as the model runner runs it
            return input_ids, slots, model(input_ids, *batch.to_device(TorchNativeBackend, BLOCK_SIZE, device))

    eager(InputBatch.from_computed(np.zeros(3, dtype=np.int64), np.array([6, 5, 7]), block_table, BLOCK_SIZE),
          [1, 0, 2])  # the context, prefilled
    verify = InputBatch.from_computed(np.array([6, 5, 7]), np.array([3, 1, 2]), block_table, BLOCK_SIZE)
    input_ids, slots, expected = eager(verify, [1, 0, 2])
    assert graphs.can_run(verify)
    with torch.inference_mode():
        replayed = graphs.run_model(input_ids, verify, slots)
    assert graphs.num_padded_replays == 1
    torch.testing.assert_close(replayed, expected, atol=1e-5, rtol=1e-5)
