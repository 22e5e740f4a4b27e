"""LoRA slots on a model's projections against transformers + PEFT (float32).

Three PEFT adapters of different ranks and target modules (q and v only;
all seven projections; the MLP only) and base-model rows run in ONE paged
batch (prefills together, then decodes and a chunked prefill beside them),
and every logit row equals PEFT's for that request's sequence; Phi-3's
fused checkpoint modules (qkv_proj, gate_up_proj) likewise. The adaptable
modules are the checkpoint's projections with its shapes (an MoE model's
shared expert, not its experts or routers). Tensor parallelism (in one
process; tests/test_lora_tp.py runs 2 gloo ranks): each rank's slots (built as rank r of 2) give exactly its
share of the full adapter product: its rows of a column-parallel (stacked,
QKV with a replicated KV head, fused) layer's, and row-parallel partial
products that sum to the full one.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
from helpers.lora_adapters import ATTENTION, MLP, write_peft_adapter
from helpers.tiny_models import cached_tiny_model
from test_models import PagedBatchRunner

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.lora.adapter import LoRAAdapter, LoRAAdapterError, base_model_modules, load_lora_adapter
from pagedllm.lora.model import LoRAModelSlots, attach_lora_slots
from pagedllm.model_registry.layers import linear
from pagedllm.model_registry.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.model_registry.loader import load_model
from pagedllm.model_registry.models.llama import LlamaForCausalLM
from pagedllm.model_registry.models.phi3 import Phi3ForCausalLM

# slot -> (rank, alpha, target modules, seed): loaded out of slot order on purpose
LLAMA_ADAPTERS = {2: (4, 8, ("q_proj", "v_proj"), 1), 3: (8, 16, ATTENTION + MLP, 2), 1: (2, 6, MLP, 3)}
MAX_RANK = 8


def peft_reference(model_dir: Path, adapter_dir: Path) -> Any:
    """transformers + PEFT with the adapter applied, over a fresh base model (float32)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="eager",
                                                local_files_only=True)
    return PeftModel.from_pretrained(base, str(adapter_dir)).eval()


def load_adapter(model_dir: Path, adapter_dir: Path, name: str) -> LoRAAdapter:
    return load_lora_adapter(adapter_dir, name=name, max_rank=MAX_RANK, max_bytes=1 << 30,
                             base_modules=base_model_modules(model_dir))


def load_with_slots(path: Path, model_cls: type, max_loras: int) -> tuple[Any, LoRAModelSlots]:
    model = load_model(path, model_cls=model_cls, attn_backend=TorchNativeBackend, dtype=torch.float32, device="cpu")
    return model, attach_lora_slots(model, max_loras=max_loras, max_rank=MAX_RANK, dtype=torch.float32, device="cpu")


class LoRABatchRunner(PagedBatchRunner):
    """PagedBatchRunner whose steps set each row's adapter slot."""

    def __init__(self, model: Any, lora: LoRAModelSlots, request_slots: list[int]) -> None:
        super().__init__(model)
        self.lora = lora
        self.request_slots = request_slots

    def step(self, schedule: list[tuple[int, int]]) -> None:
        rows = [self.request_slots[r] for r, num_new in schedule for _ in range(num_new)]
        self.lora.state.token_slots = torch.tensor(rows, dtype=torch.int32)
        super().step(schedule)


def run_mixed_batch(model: Any, lora: LoRAModelSlots, request_slots: list[int]) -> LoRABatchRunner:
    gen = torch.Generator().manual_seed(7)
    runner = LoRABatchRunner(model, lora, request_slots)
    prompt_lens = (5, 9, 6, 7, 11)[: len(request_slots) - 1]
    for length in prompt_lens:
        runner.add_request(torch.randint(model.config.vocab_size, (length,), generator=gen).tolist())
    runner.step([(r, n) for r, n in enumerate(prompt_lens)])  # every adapter and the base, one forward
    for _ in range(2):
        runner.step([(r, 1) for r in range(len(prompt_lens))])
    late = runner.add_request(torch.randint(model.config.vocab_size, (8,), generator=gen).tolist())
    runner.step([(0, 1), (late, 5), (1, 1)])  # a prefill chunk beside decodes
    runner.step([(late, 3), *[(r, 1) for r in range(len(prompt_lens))]])
    return runner


def assert_rows_match_peft(runner: LoRABatchRunner, references: dict[int, Any]) -> None:
    for r, tokens in enumerate(runner.tokens):
        num_computed = runner.num_computed[r]
        with torch.no_grad():
            expected = references[runner.request_slots[r]](torch.tensor([tokens[:num_computed]])).logits[0]
        ours = torch.stack([runner.logits[r][pos] for pos in range(num_computed)])
        torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
        assert tokens[runner.prompt_lens[r]:] == expected[runner.prompt_lens[r] - 1 :].argmax(-1).tolist()


def build_references(path: Path, tmp_path: Path, adapters: dict[int, tuple[Any, ...]],
                     lora: LoRAModelSlots) -> dict[int, Any]:
    """Each adapter written with PEFT, loaded into its slot; slot -> its reference model (0: the base)."""
    from test_models import hf_model

    references: dict[int, Any] = {0: hf_model(path)}
    for slot, (rank, alpha, targets, seed) in adapters.items():
        adapter_dir = write_peft_adapter(path, tmp_path / f"adapter{slot}", rank=rank, alpha=alpha,
                                         target_modules=targets, seed=seed)
        lora.load_slot(slot, load_adapter(path, adapter_dir, f"adapter{slot}").weights)
        references[slot] = peft_reference(path, adapter_dir)
    return references


def test_three_adapters_and_the_base_in_one_batch_match_peft(tmp_path: Path) -> None:
    path = cached_tiny_model("llama")
    model, lora = load_with_slots(path, LlamaForCausalLM, max_loras=3)
    references = build_references(path, tmp_path, LLAMA_ADAPTERS, lora)
    runner = run_mixed_batch(model, lora, [2, 0, 3, 1, 0])
    assert_rows_match_peft(runner, references)
    # Each adapter changes its rows: the comparison could fail.
    base = torch.stack([runner.logits[0][pos] for pos in range(5)])
    with torch.no_grad():
        unadapted = references[0](torch.tensor([runner.tokens[0][:5]])).logits[0]
    assert (base - unadapted).abs().max() > 1e-2


def test_phi3_fused_qkv_and_gate_up_modules_match_peft(tmp_path: Path) -> None:
    path = cached_tiny_model("phi3", pad_token_id=0)
    model, lora = load_with_slots(path, Phi3ForCausalLM, max_loras=2)
    assert {"model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj"} <= set(lora.supported_modules())
    assert lora.supported_modules()["model.layers.0.self_attn.qkv_proj"] == (16 * (4 + 2 + 2), 64)
    adapters = {1: (4, 8, ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), 4), 2: (8, 8, ("qkv_proj",), 5)}
    references = build_references(path, tmp_path, adapters, lora)
    assert_rows_match_peft(run_mixed_batch(model, lora, [1, 0, 2]), references)


@pytest.mark.parametrize(("arch", "projections"), [
    ("llama", ATTENTION + MLP), ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))])
def test_every_projection_is_adaptable_under_its_checkpoint_name_and_shape(arch: str,
                                                                         projections: tuple[str, ...]) -> None:
    path = cached_tiny_model(arch, pad_token_id=0)
    _, lora = load_with_slots(path, Phi3ForCausalLM if arch == "phi3" else LlamaForCausalLM, max_loras=1)
    checkpoint = base_model_modules(path)
    assert checkpoint is not None
    assert lora.supported_modules() == {
        module: shape for module, shape in checkpoint.items() if module.rpartition(".")[2] in projections
    }


def test_moe_experts_and_routers_get_no_slots_but_the_shared_expert_does(tmp_path: Path) -> None:
    from test_models_moe import build_moe

    from pagedllm.model_registry.models.qwen2_moe import Qwen2MoeForCausalLM

    path = build_moe("Qwen2MoeForCausalLM", tmp_path / "model")
    _, lora = load_with_slots(path, Qwen2MoeForCausalLM, max_loras=1)
    checkpoint = base_model_modules(path)
    assert checkpoint is not None
    assert lora.supported_modules() == {
        module: shape for module, shape in checkpoint.items()
        if module.rpartition(".")[2] in ATTENTION or ".shared_expert." in module
    }
    expert = "model.layers.0.mlp.experts.0.up_proj"
    with pytest.raises(LoRAAdapterError, match=expert):
        lora.load_slot(1, {f"{expert}.lora_A": torch.zeros(2, checkpoint[expert][1]),
                           f"{expert}.lora_B": torch.zeros(checkpoint[expert][0], 2)})


def test_reloading_a_slot_replaces_the_adapter_and_clearing_restores_the_base() -> None:
    path = cached_tiny_model("llama")
    model, lora = load_with_slots(path, LlamaForCausalLM, max_loras=1)
    module = "model.layers.0.self_attn.k_proj"
    gen = torch.Generator().manual_seed(0)
    big = {f"{module}.lora_A": torch.randn(8, 64, generator=gen),
           f"{module}.lora_B": torch.randn(32, 8, generator=gen)}
    small = {f"{module}.lora_A": torch.randn(2, 64, generator=gen),
             f"{module}.lora_B": torch.randn(32, 2, generator=gen)}
    slots = model.model.layers[0].self_attn.qkv_proj.lora_slots
    lora.load_slot(1, big)
    lora.load_slot(1, small)  # rank 2 over rank 8: nothing of the first may remain
    expected_a = torch.zeros(3 * MAX_RANK, 64)
    expected_a[MAX_RANK : MAX_RANK + 2] = small[f"{module}.lora_A"]
    expected_b = torch.zeros(64 + 32 + 32, 3 * MAX_RANK)
    expected_b[64:96, MAX_RANK : MAX_RANK + 2] = small[f"{module}.lora_B"]
    assert torch.equal(slots.lora_a[1], expected_a) and torch.equal(slots.lora_b[1], expected_b)
    lora.clear_slot(1)
    assert not slots.lora_a.any() and not slots.lora_b.any()


@pytest.mark.parametrize(("weights", "message"), [
    ({"model.embed_tokens.lora_A": torch.zeros(2, 512), "model.embed_tokens.lora_B": torch.zeros(64, 2)},
     "model.embed_tokens"),
    ({"lm_head.lora_A": torch.zeros(2, 64), "lm_head.lora_B": torch.zeros(512, 2)}, "lm_head"),
    ({"model.layers.0.mlp.up_proj.lora_A": torch.zeros(9, 64),
      "model.layers.0.mlp.up_proj.lora_B": torch.zeros(128, 9)}, "max_lora_rank=8"),
    ({"model.layers.0.mlp.up_proj.lora_A": torch.zeros(2, 64),
      "model.layers.0.mlp.up_proj.lora_B": torch.zeros(64, 2)}, r"out=128, in=64"),
])
def test_an_adapter_module_the_slots_cannot_hold_is_a_clear_error(weights: dict[str, torch.Tensor],
                                                                   message: str) -> None:
    _, lora = load_with_slots(cached_tiny_model("llama"), LlamaForCausalLM, max_loras=1)
    with pytest.raises(LoRAAdapterError, match=message):
        lora.load_slot(1, weights)


# ----------------------------------------------------- tensor parallelism

HIDDEN, HEAD_SIZE, NUM_HEADS, RANK = 8, 4, 4, 3


class StackedBlock(torch.nn.Module):
    """A decoder block's projections as Llama stacks them; 1 KV head: replicated on both ranks."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, 1)
        self.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [10, 10])
        self.o_proj = RowParallelLinear(12, HIDDEN)


class FusedBlock(StackedBlock):
    """The same layers, the checkpoint holding qkv_proj and gate_up_proj fused (Phi-3)."""

    packed_modules_mapping: ClassVar[dict[str, tuple[str, int]]] = {}


def random_adapter(shapes: dict[str, tuple[int, int]]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    weights = {}
    for module, (out_size, in_size) in shapes.items():
        weights[f"{module}.lora_A"] = torch.randn(RANK, in_size, generator=gen)
        weights[f"{module}.lora_B"] = torch.randn(out_size, RANK, generator=gen)
    return weights


def rank_products(block_cls: type, monkeypatch: pytest.MonkeyPatch, x: dict[str, torch.Tensor]) -> list[Any]:
    """Each of 2 ranks' adapter products {layer: [T, this rank's out]} on slot 1, and the adapter."""
    results = []
    for rank in (0, 1):
        monkeypatch.setattr(linear, "get_tp_group", lambda rank=rank: SimpleNamespace(rank_in_group=rank,
                                                                                        world_size=2))
        block = block_cls()
        lora = attach_lora_slots(block, max_loras=1, max_rank=4, dtype=torch.float32, device="cpu")
        adapter = random_adapter(lora.supported_modules())
        lora.load_slot(1, adapter)
        lora.state.token_slots = torch.tensor([1, 0, 1], dtype=torch.int32)
        products = {}
        for name in ("qkv_proj", "gate_up_proj", "o_proj"):
            layer = getattr(block, name)
            inputs = x[name] if name != "o_proj" else x[name].chunk(2, dim=-1)[rank]
            products[name] = torch.zeros(3, layer.out_features)
            layer.lora_slots.add_lora(products[name], inputs)
        results.append((products, adapter))
    return results


def full_product(x: torch.Tensor, adapter: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    product = x @ adapter[f"{module}.lora_A"].T @ adapter[f"{module}.lora_B"].T
    product[1] = 0  # the base row
    return product


def test_each_rank_holds_its_shard_of_stacked_and_fused_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(0)
    x = {"qkv_proj": torch.randn(3, HIDDEN, generator=gen), "gate_up_proj": torch.randn(3, HIDDEN, generator=gen),
         "o_proj": torch.randn(3, 12, generator=gen)}
    for block_cls in (StackedBlock, FusedBlock):
        ranks = rank_products(block_cls, monkeypatch, x)
        adapter = ranks[0][1]
        assert ranks[1][1].keys() == adapter.keys()  # both ranks see the full checkpoint shapes
        if block_cls is StackedBlock:
            q, k, v = (full_product(x["qkv_proj"], adapter, m) for m in ("q_proj", "k_proj", "v_proj"))
            gate, up = (full_product(x["gate_up_proj"], adapter, m) for m in ("gate_proj", "up_proj"))
        else:
            q, k, v = full_product(x["qkv_proj"], adapter, "qkv_proj").split([16, 4, 4], dim=-1)
            gate, up = full_product(x["gate_up_proj"], adapter, "gate_up_proj").chunk(2, dim=-1)
        for rank, (products, _) in enumerate(ranks):
            # Query heads 2r, 2r + 1; the one KV head whole on both ranks.
            torch.testing.assert_close(products["qkv_proj"], torch.cat([q[:, 8 * rank : 8 * rank + 8], k, v], -1))
            torch.testing.assert_close(products["gate_up_proj"],
                                       torch.cat([gate.chunk(2, -1)[rank], up.chunk(2, -1)[rank]], -1))
        # Row-parallel: partial products the all-reduce sums into the full one.
        torch.testing.assert_close(ranks[0][0]["o_proj"] + ranks[1][0]["o_proj"],
                                   full_product(x["o_proj"], adapter, "o_proj"))
