"""LoRA adapters at TP=2 (2 gloo ranks) give TP=1's logits.

Each rank loads its half of the model, attaches adapter slots to its shards
of the layers and copies its shard of two PEFT adapters into them (through
the loader, as the engine core hands them out); then a paged prefill and a
decode step with one request per adapter and one of the base model in the
same batch. Checkpoints: Llama with ONE KV head (replicated on both ranks:
each rank's k/v adapter rows are the whole head's) and Phi-3 (fused
qkv_proj / gate_up_proj modules, split per rank as their weights are).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.lora_adapters import ATTENTION, MLP, write_peft_adapter
from helpers.tiny_models import cached_tiny_model
from test_tp_models import BLOCK_SIZE, BLOCKS_PER_REQUEST, _metadata

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.lora.adapter import load_lora_adapter
from pagedllm.lora.model import attach_lora_slots
from pagedllm.model_registry.loader import load_model
from pagedllm.model_registry.models.llama import LlamaForCausalLM
from pagedllm.model_registry.models.phi3 import Phi3ForCausalLM

PROMPTS = [[1, 17, 300, 42, 5, 99, 260], [7, 400, 3, 250, 12], [9, 8, 7, 6]]
DECODE_TOKENS = [11, 23, 31]
REQUEST_SLOTS = [1, 0, 2]
# name -> (architecture, model class, config overrides, each adapter's target modules)
MODELS: dict[str, tuple[str, type, dict[str, Any], tuple[tuple[str, ...], ...]]] = {
    "llama-1-kv-head": ("llama", LlamaForCausalLM, {"num_key_value_heads": 1},
                        (ATTENTION + MLP, ("k_proj", "v_proj", "down_proj"))),
    "phi3": ("phi3", Phi3ForCausalLM, {"pad_token_id": 0},
             (("qkv_proj", "o_proj", "gate_up_proj", "down_proj"), ("qkv_proj",))),
}


def run_two_steps(model_cls: type, path: Path, adapter_dirs: list[Path]) -> torch.Tensor:
    """Logits of a prefill and a decode step, requests in slots REQUEST_SLOTS (None adapters: no slots)."""
    model = load_model(path, model_cls=model_cls, attn_backend=TorchNativeBackend, dtype=torch.float32, device="cpu")
    lora = attach_lora_slots(model, max_loras=2, max_rank=8, dtype=torch.float32, device="cpu")
    for slot, adapter_dir in enumerate(adapter_dirs, start=1):
        lora.load_slot(slot, load_lora_adapter(adapter_dir, name=f"a{slot}", max_rank=8, max_bytes=1 << 30).weights)
    num_blocks = len(PROMPTS) * BLOCKS_PER_REQUEST
    for attn in model.get_attention_layers():
        shape = TorchNativeBackend.get_kv_cache_shape(num_blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_size)
        attn.kv_cache = torch.full(shape, float("nan"))
    prompt_lens = [len(p) for p in PROMPTS]
    steps = [
        ([t for p in PROMPTS for t in p], [pos for n in prompt_lens for pos in range(n)],
         _metadata([0] * len(PROMPTS), prompt_lens), prompt_lens),
        (DECODE_TOKENS, prompt_lens, _metadata(prompt_lens, [1] * len(PROMPTS)), [1] * len(PROMPTS)),
    ]
    logits = []
    with torch.no_grad():
        for input_ids, positions, metadata, query_lens in steps:
            lora.state.token_slots = torch.tensor(REQUEST_SLOTS, dtype=torch.int32).repeat_interleave(
                torch.tensor(query_lens))
            logits.append(model.compute_logits(model(torch.tensor(input_ids), torch.tensor(positions), metadata)))
    return torch.cat(logits)


@pytest.fixture(scope="module")
def cases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[type, Path, list[Path]]]:
    found = {}
    for name, (arch, model_cls, overrides, targets) in MODELS.items():
        path = cached_tiny_model(arch, **overrides)
        adapter_dirs = [
            write_peft_adapter(path, tmp_path_factory.mktemp(f"{name}-a{i}"), rank=rank, target_modules=modules,
                               seed=i)
            for i, (rank, modules) in enumerate(zip((8, 3), targets, strict=True))
        ]
        found[name] = (model_cls, path, adapter_dirs)
    return found


def test_tp2_adapter_logits_equal_tp1(cases: dict[str, tuple[type, Path, list[Path]]],
                                      tmp_path: Path) -> None:
    from helpers.tp_ranks import run_ranks

    args = [f"{name}={path}|{'|'.join(map(str, dirs))}" for name, (_, path, dirs) in cases.items()]
    ranks = run_ranks(__file__, 2, tmp_path, *args, timeout=120)
    for name, (model_cls, path, adapter_dirs) in cases.items():
        expected = run_two_steps(model_cls, path, adapter_dirs)
        base = run_two_steps(model_cls, path, [])
        rows = [0, len(PROMPTS[0]) - 1, sum(map(len, PROMPTS)) + 2]  # request 0's and 2's rows: adapted
        assert (expected[rows] - base[rows]).abs().amax() > 1e-2, name  # the adapters matter
        for rank, results in enumerate(ranks):
            torch.testing.assert_close(results[name], expected, atol=1e-5, rtol=1e-5, msg=f"{name} rank {rank}")
            assert torch.equal(results[name].argmax(-1), expected.argmax(-1))


if __name__ == "__main__":  # one rank of test_tp2_adapter_logits_equal_tp1
    from helpers.tp_ranks import init_rank_from_argv

    from pagedllm.distributed.parallel_state import destroy_distributed_environment

    tp_rank, _, out_dir, named = init_rank_from_argv()
    results = {}
    for item in named:
        name, paths = item.split("=", 1)
        path, *dirs = paths.split("|")
        results[name] = run_two_steps(MODELS[name][1], Path(path), [Path(d) for d in dirs])
    torch.save(results, out_dir / f"rank{tp_rank}.pt")
    destroy_distributed_environment()
    sys.exit(0)
