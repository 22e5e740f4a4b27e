"""Latent attention (MLA) on the triton backend (attention_backends/triton/mla.py)
against the torch MLA impl on the same hand-built paged latent caches:
several requests of different lengths, block tables out of order, fresh
prefills, chunks over cached context, decodes and a slot of -1. On CPU
through the Triton interpreter (TRITON_INTERPRET=1, set by conftest); with
PAGEDLLM_TEST_DEVICE=cuda and TRITON_INTERPRET=0 the same cases run compiled
on a GPU. bfloat16 is compared on a GPU only (the interpreter's bfloat16
`tl.dot` is wrong). Also: a DeepSeek model on a CUDA device gets `triton`."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from helpers.attention_case import DEVICE, paged_metadata

from pagedllm.attention_backends.base import AttentionMetadata
from pagedllm.attention_backends.kv_cache_dtype import write_kv
from pagedllm.attention_backends.mla import MLA_KV_CACHE_LAYOUT
from pagedllm.attention_backends.torch_mla import TorchMLAImpl
from pagedllm.attention_backends.torch_native import TorchNativeBackend

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and DEVICE.type != "cuda",
    reason="needs the Triton interpreter or a CUDA device",
)

triton_mla = pytest.importorskip("pagedllm.attention_backends.triton.mla")
latent_kernels = pytest.importorskip("pagedllm.attention_backends.triton.latent_attention")

# 18 heads: two head blocks of 16, the second mostly masked. L and R are not
# powers of two: the padded dims are masked.
HEADS, RANK, NOPE, ROPE, V_DIM = 18, 24, 8, 6, 12
BLOCK_SIZE, NUM_BLOCKS = 16, 12
SCALE = 0.3
TABLES = [[5, 2, 9], [7, 1, 11], [10, 4, 0]]
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3),
             torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
# Each step: [(request, first position, num tokens)]; request r's token at
# position p is input row 100 * r + p.
STEPS = [
    [(0, 0, 20), (1, 0, 3)],  # fresh prefills
    [(0, 20, 1), (2, 0, 35), (1, 3, 1)],  # decodes beside a fresh prefill
    [(1, 4, 9), (0, 21, 1), (2, 35, 1)],  # a chunk over cached context beside decodes
    [(0, 22, 1), (1, 13, 1), (2, 36, 1)],  # decodes (one of them not written: slot -1)
]
UNWRITTEN = (2, 36)  # (request, position) whose slot is -1


def _inputs(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    num_rows = 300
    inputs = {"q_nope": torch.randn(num_rows, HEADS, NOPE, generator=gen),
              "q_pe": torch.randn(num_rows, HEADS, ROPE, generator=gen),
              "kv_c": torch.randn(num_rows, RANK, generator=gen),
              "k_pe": torch.randn(num_rows, ROPE, generator=gen),
              "kv_b": torch.randn(HEADS * (NOPE + V_DIM), RANK, generator=gen) / RANK**0.5}
    return {name: x.to(dtype) for name, x in inputs.items()}


def _step_metadata(steps: list[tuple[int, int, int]]) -> tuple[AttentionMetadata, torch.Tensor]:
    """(metadata on the CPU, input rows) of one flattened batch."""
    rows = torch.cat([torch.arange(start, start + n) + 100 * r for r, start, n in steps])
    slots = [-1 if (r, p) == UNWRITTEN else TABLES[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
             for r, start, n in steps for p in range(start, start + n)]
    block_table = torch.tensor([TABLES[r] for r, _, _ in steps], dtype=torch.int32)
    metadata = paged_metadata([n for _, _, n in steps], [s + n for _, s, n in steps], block_table, slots)
    return metadata, rows


def _on_device(metadata: AttentionMetadata) -> AttentionMetadata:
    return dataclasses.replace(metadata, **{name: getattr(metadata, name).to(DEVICE) for name in
                                            ("query_start_loc", "seq_lens", "block_table", "slot_mapping")})


def _initial_cache(dtype: torch.dtype) -> torch.Tensor:
    """Finite junk in every slot: the unwritten slot reads the same junk in both impls."""
    shape = MLA_KV_CACHE_LAYOUT.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, 1, RANK + ROPE)
    return torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("skip_fresh", [True, False], ids=["fresh-expanded", "all-absorbed"])
def test_triton_mla_equals_torch_mla(dtype: torch.dtype, skip_fresh: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs and caches after each step equal the torch impl's. all-absorbed:
    fresh prefills through the kernel too (what a captured step does)."""
    if not skip_fresh:
        monkeypatch.setattr(triton_mla, "fresh_prefill_rows", lambda metadata: [])
    inputs = _inputs(dtype)
    torch_impl = TorchMLAImpl(HEADS, RANK, NOPE, ROPE, V_DIM, SCALE)
    triton_impl = triton_mla.TritonMLAImpl(HEADS, RANK, NOPE, ROPE, V_DIM, SCALE)
    torch_cache, triton_cache = _initial_cache(dtype), _initial_cache(dtype).to(DEVICE)
    for steps in STEPS:
        metadata, rows = _step_metadata(steps)
        args = [inputs[name][rows] for name in ("q_nope", "q_pe", "kv_c", "k_pe")] + [inputs["kv_b"]]
        expected = torch_impl.forward(*args, torch_cache, TorchNativeBackend.build_metadata(metadata, BLOCK_SIZE))
        out = triton_impl.forward(*(x.to(DEVICE) for x in args), triton_cache, _on_device(metadata))
        torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[dtype])
        torch.testing.assert_close(triton_cache.cpu(), torch_cache, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_latent_cache_write_skips_slot_minus_one(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    kv_c, k_pe = torch.randn(5, RANK, generator=gen).to(dtype), torch.randn(5, ROPE, generator=gen).to(dtype)
    slots = torch.tensor([17, -1, 3, 40, 191])
    cache = _initial_cache(dtype)
    expected = cache.clone()
    written = slots >= 0
    write_kv(expected[0].view(-1, RANK + ROPE), slots[written], torch.cat([kv_c, k_pe], dim=-1)[written])
    on_device = cache.to(DEVICE)
    latent_kernels.write_latent_cache(kv_c.to(DEVICE), k_pe.to(DEVICE), on_device, slots.to(DEVICE))
    assert torch.equal(on_device.cpu(), expected)


def test_deepseek_on_cuda_gets_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DeepSeek-V2-Lite-sized latent (512 + 64 = 576 wide, past triton's
    per-head max_head_size of 256) on simulated CUDA devices."""
    from test_backend_selection import simulate_device
    from transformers import DeepseekV2Config

    from pagedllm.attention_backends.selector import select_attention_backend
    from pagedllm.model_registry.models.deepseek_v2 import DeepseekV2ForCausalLM
    from pagedllm.platforms.cuda import CudaPlatform

    config = DeepseekV2Config(kv_lora_rank=512, qk_rope_head_dim=64)
    requirements = DeepseekV2ForCausalLM.attention_requirements(config)
    for capability, installed in (((7, 5), ("triton",)), ((9, 0), ("triton", "flash_attn"))):
        simulate_device(monkeypatch, capability, installed)
        selection = select_attention_backend(CudaPlatform(), head_size=576, dtype=torch.float16, block_size=16,
                                             requirements=requirements, load=False)
        assert selection.name == "triton"
        if "flash_attn" in installed:
            assert "latent attention (MLA) is not supported" in selection.rejected["flash_attn"]
