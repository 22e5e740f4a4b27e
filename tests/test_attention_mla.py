"""Latent attention (MLA) on the cpu backend: the absorbed form (decodes,
chunks over cached context) and the expanded form (fresh prefills) each
equal a plain expanded computation (per-head K and V from the latents,
causal softmax) in float32; backends without MLA are refused by name."""

from __future__ import annotations

import pytest
import torch
from helpers.attention_case import paged_metadata

from pagedllm.attention_backends.mla import MLA_KV_CACHE_LAYOUT
from pagedllm.attention_backends.torch_mla import TorchMLAImpl
from pagedllm.attention_backends.torch_native import TorchNativeBackend

HEADS, RANK, NOPE, ROPE, V_DIM = 3, 16, 8, 4, 12
BLOCK_SIZE, NUM_BLOCKS = 4, 32
SCALE = 0.3


def expanded_reference(q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, kv_b: torch.Tensor,
                       num_context: int) -> torch.Tensor:
    """One request's rows: query i sits at position num_context + i and
    attends latents 0..num_context + i, every head's K and V expanded."""
    per_head = kv_b.view(HEADS, NOPE + V_DIM, RANK)
    kv_c, k_pe = latent.split([RANK, ROPE], dim=-1)
    keys = torch.cat([torch.einsum("sl,hdl->hsd", kv_c, per_head[:, :NOPE]),
                      k_pe[None].expand(HEADS, -1, -1)], dim=-1)  # [H, S, Dn + R]
    values = torch.einsum("sl,hvl->hsv", kv_c, per_head[:, NOPE:])  # [H, S, Dv]
    query = torch.cat([q_nope, q_pe], dim=-1).transpose(0, 1)  # [H, Q, Dn + R]
    scores = query @ keys.transpose(1, 2) * SCALE
    positions = torch.arange(num_context, num_context + q_nope.shape[0])
    scores = scores.masked_fill(torch.arange(latent.shape[0])[None, :] > positions[:, None], float("-inf"))
    return (scores.softmax(-1) @ values).transpose(0, 1)  # [Q, H, Dv]


def _run(impl: TorchMLAImpl, cache: torch.Tensor, tables: list[list[int]], steps: list[tuple[int, int, int]],
         inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """One flattened batch: steps = [(request, first position, num tokens)]."""
    rows = [torch.arange(start, start + n) + 100 * r for r, start, n in steps]
    slots = [tables[r][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for r, start, n in steps
             for p in range(start, start + n)]
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in (tables[r] for r, _, _ in steps)],
                               dtype=torch.int32)
    metadata = TorchNativeBackend.build_metadata(
        paged_metadata([n for _, _, n in steps], [s + n for _, s, n in steps], block_table, slots), BLOCK_SIZE)
    index = torch.cat(rows)
    return impl.forward(inputs["q_nope"][index], inputs["q_pe"][index], inputs["kv_c"][index], inputs["k_pe"][index],
                        inputs["kv_b"], cache, metadata)


def test_absorbed_and_expanded_paths_equal_an_expanded_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    num_rows = 300  # request r's position p is row 100 * r + p

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    inputs = {"q_nope": randn(num_rows, HEADS, NOPE), "q_pe": randn(num_rows, HEADS, ROPE),
              "kv_c": randn(num_rows, RANK), "k_pe": randn(num_rows, ROPE), "kv_b": randn(HEADS * (NOPE + V_DIM), RANK)}
    impl = TorchMLAImpl(HEADS, RANK, NOPE, ROPE, V_DIM, SCALE)
    cache = torch.full(MLA_KV_CACHE_LAYOUT.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, 1, RANK + ROPE), float("nan"))
    tables = [[5, 2, 9, 14], [7, 1, 30, 3], [11, 4, 20, 8]]

    def reference(r: int, start: int, n: int) -> torch.Tensor:
        rows = slice(100 * r, 100 * r + start + n)
        latent = torch.cat([inputs["kv_c"][rows], inputs["k_pe"][rows]], dim=-1)
        queries = slice(100 * r + start, 100 * r + start + n)
        return expanded_reference(inputs["q_nope"][queries], inputs["q_pe"][queries], latent, inputs["kv_b"], start)

    # Fresh prefills (expanded), then a chunk over context beside decodes, then decodes (absorbed).
    for steps in ([(0, 0, 6), (1, 0, 9)], [(0, 6, 1), (2, 0, 5), (1, 9, 1)], [(2, 5, 7), (0, 7, 1), (1, 10, 1)],
                  [(0, 8, 1), (1, 11, 1), (2, 12, 1)]):
        out = _run(impl, cache, tables, steps, inputs)
        expected = torch.cat([reference(r, start, n) for r, start, n in steps])
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_absorbed_decode_equals_the_expanded_prefill_of_the_same_rows() -> None:
    """The two forms of the impl itself, over the same latents."""
    gen = torch.Generator().manual_seed(1)
    impl = TorchMLAImpl(HEADS, RANK, NOPE, ROPE, V_DIM, SCALE)
    length = 10
    q_nope, q_pe = torch.randn(length, HEADS, NOPE, generator=gen), torch.randn(length, HEADS, ROPE, generator=gen)
    latent = torch.randn(length, RANK + ROPE, generator=gen)
    w_uk, w_uv = impl.split_kv_b(torch.randn(HEADS * (NOPE + V_DIM), RANK, generator=gen))
    expanded = impl.expanded_prefill(q_nope, q_pe, latent, w_uk, w_uv)
    cache = MLA_KV_CACHE_LAYOUT.kv_cache_shape(4, BLOCK_SIZE, 1, RANK + ROPE)
    flat = torch.zeros(cache).view(-1, RANK + ROPE)
    flat[:length] = latent
    table = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    plan = TorchNativeBackend.build_metadata(
        paged_metadata([length - 1], [length], table, list(range(1, length))), BLOCK_SIZE).plan
    assert plan is not None and not plan.fresh_prefill_rows
    absorbed = impl.absorbed(q_nope[1:], q_pe[1:], flat, plan.gather_groups[0], w_uk, w_uv)
    torch.testing.assert_close(absorbed, expanded[1:], rtol=1e-5, atol=1e-5)


def test_a_backend_without_mla_is_refused_by_name() -> None:
    from pagedllm.attention_backends.base import AttentionRequirements
    from pagedllm.attention_backends.selector import check_backend
    from pagedllm.core.errors import AttentionBackendError
    from pagedllm.platforms.cpu.platform import CpuPlatform
    from pagedllm.plugins import get_plugin_manager

    registry = get_plugin_manager().attention_backends
    requirements = AttentionRequirements((40,), latent_kv_size=40)
    checks = dict(head_size=40, dtype=torch.float32, block_size=16, requirements=requirements)
    assert check_backend(registry.get("cpu"), CpuPlatform(), **checks) == []
    assert "latent attention (MLA) is not supported" in check_backend(registry.get("flash_attn"), CpuPlatform(),
                                                                       **checks)
    from pagedllm.attention_backends.base import AttentionBackend

    class NoMLA(AttentionBackend):
        name = "no_mla"

        @staticmethod
        def get_impl_cls() -> type:
            raise NotImplementedError

    with pytest.raises(AttentionBackendError, match=r"no_mla.*latent attention"):
        NoMLA.get_mla_impl_cls()
