"""Tensor-parallel layers against the plain full layers (float32).

In one process: at world size 1 each layer is the nn.Linear / nn.Embedding it
replaced (exact), and each rank's weight_loader takes exactly its rows or
columns of the full checkpoint tensor (a stand-in group of 2 gives the rank).
With 2 gloo ranks: every layer's output equals the full layer on the same
input: exact where a rank only selects (column slices, embedding rows: a sum
with zeros is exact), allclose (atol 1e-6) where an all-reduce sums partial
products in a different order than the full GEMM.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.core.errors import ConfigError
from pagedllm.model_registry.layers import linear, vocab_parallel_embedding
from pagedllm.model_registry.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedllm.model_registry.layers.logits_head import LogitsHead
from pagedllm.model_registry.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
    vocab_shard,
)

HIDDEN, HEAD_SIZE, NUM_HEADS = 8, 4, 4
VOCAB = 11  # odd: the last rank's vocabulary shard is padded
IDS = [0, 5, 6, 10, 3, 7, 9]  # both halves of the vocabulary (rank 0: 0-5, rank 1: 6-10)


def reference_tensors() -> dict[str, torch.Tensor]:
    """The full checkpoint tensors and inputs every rank and the parent share."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return {
        "x": randn(5, HIDDEN),
        "column.weight": randn(12, HIDDEN), "column.bias": randn(12),
        "row.weight": randn(6, 12), "row.bias": randn(6), "row.x": randn(5, 12),
        "gate": randn(10, HIDDEN), "up": randn(10, HIDDEN),
        "q": randn(NUM_HEADS * HEAD_SIZE, HIDDEN), "q.bias": randn(NUM_HEADS * HEAD_SIZE),
        "k2": randn(2 * HEAD_SIZE, HIDDEN), "v2": randn(2 * HEAD_SIZE, HIDDEN),
        "k1": randn(HEAD_SIZE, HIDDEN), "v1": randn(HEAD_SIZE, HIDDEN),
        "k2.bias": randn(2 * HEAD_SIZE), "v2.bias": randn(2 * HEAD_SIZE),
        "embed": randn(VOCAB, HIDDEN), "hidden": randn(3, HIDDEN),
    }


def build_layers(t: dict[str, torch.Tensor]) -> dict[str, nn.Module]:
    """Each parallel layer, filled from the full tensors through its weight_loader."""
    column = ColumnParallelLinear(HIDDEN, 12, bias=True, gather_output=True)
    column.weight_loader(column.weight, t["column.weight"])
    column.weight_loader(column.bias, t["column.bias"])
    row = RowParallelLinear(12, 6, bias=True)
    row.weight_loader(row.weight, t["row.weight"])
    row.weight_loader(row.bias, t["row.bias"])
    gate_up = MergedColumnParallelLinear(HIDDEN, [10, 10])
    gate_up.weight_loader(gate_up.weight, t["gate"], 0)
    gate_up.weight_loader(gate_up.weight, t["up"], 1)
    layers: dict[str, nn.Module] = {"column": column, "row": row, "gate_up": gate_up}
    for num_kv_heads in (2, 1):
        qkv = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, num_kv_heads, bias=num_kv_heads == 2)
        for shard_id, name in enumerate(("q", f"k{num_kv_heads}", f"v{num_kv_heads}")):
            qkv.weight_loader(qkv.weight, t[name], shard_id)
            if qkv.bias is not None:
                qkv.weight_loader(qkv.bias, t[f"{name}.bias"], shard_id)
        layers[f"qkv{num_kv_heads}"] = qkv
    embed = VocabParallelEmbedding(VOCAB, HIDDEN)
    embed.weight_loader(embed.weight, t["embed"])
    lm_head = ParallelLMHead(VOCAB, HIDDEN)
    lm_head.weight_loader(lm_head.weight, t["embed"])
    return layers | {"embed": embed, "lm_head": lm_head}


def run_layers(layers: dict[str, Any], t: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, Any]:
    x = t["x"]
    row_x = t["row.x"].chunk(tp_size, dim=-1)[tp_rank]  # the input a column-parallel layer left split
    with torch.no_grad():
        column_slice = layers["column"].apply_linear(x, layers["column"].bias)
        return {
            "column.gathered": layers["column"](x),
            "column.slice": column_slice,
            "row": layers["row"](row_x),
            "gate_up": layers["gate_up"](x),
            "qkv2": layers["qkv2"](x),
            "qkv1": layers["qkv1"](x),
            "embed": layers["embed"](torch.tensor(IDS)),
            "logits": LogitsHead(VOCAB)(layers["lm_head"], t["hidden"]),
            "num_kv_heads": (layers["qkv2"].num_kv_heads, layers["qkv1"].num_kv_heads),
        }


def expected_outputs(t: dict[str, torch.Tensor], tp_rank: int, tp_size: int) -> dict[str, Any]:
    """What rank `tp_rank` of `tp_size` must compute, from the full layers."""
    x = t["x"]

    def mine(full: torch.Tensor, num_heads: int = 0) -> torch.Tensor:  # this rank's columns
        return full.chunk(tp_size, dim=-1)[tp_rank] if num_heads == 0 or num_heads >= tp_size else full

    q = F.linear(x, t["q"], t["q.bias"])
    qkv = {n: torch.cat([mine(q), mine(F.linear(x, t[f"k{n}"], t[f"k{n}.bias"] if n == 2 else None), n),
                         mine(F.linear(x, t[f"v{n}"], t[f"v{n}.bias"] if n == 2 else None), n)], dim=-1)
           for n in (2, 1)}
    qkv[1] = torch.cat([mine(F.linear(x, t["q"])), qkv[1][:, -2 * HEAD_SIZE:]], dim=-1)
    column = F.linear(x, t["column.weight"], t["column.bias"])
    return {
        "column.gathered": column,
        "column.slice": mine(column),
        "row": F.linear(t["row.x"], t["row.weight"], t["row.bias"]),
        "gate_up": torch.cat([mine(F.linear(x, t["gate"])), mine(F.linear(x, t["up"]))], dim=-1),
        "qkv2": qkv[2],
        "qkv1": qkv[1],
        "embed": F.embedding(torch.tensor(IDS), t["embed"]),
        "logits": F.linear(t["hidden"], t["embed"]),
        "num_kv_heads": (2 // tp_size, 1),
    }


def assert_matches(got: dict[str, Any], expected: dict[str, Any], exact: set[str]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        if isinstance(value, torch.Tensor):
            assert got[name].shape == value.shape, name
            if name in exact:
                assert torch.equal(got[name], value), name
            else:
                torch.testing.assert_close(got[name], value, rtol=0, atol=1e-6, msg=name)
        else:
            assert got[name] == value, name


def test_world_size_one_layers_equal_the_full_layers_exactly() -> None:
    """Bit-identical to the nn.Linear (stacked q/k/v and gate/up, as before) and nn.Embedding they replace."""
    t = reference_tensors()
    got = run_layers(build_layers(t), t, 0, 1)
    x = t["x"]
    stacked_bias = torch.cat([t["q.bias"], t["k2.bias"], t["v2.bias"]])
    expected = expected_outputs(t, 0, 1) | {
        "gate_up": F.linear(x, torch.cat([t["gate"], t["up"]])),
        "qkv2": F.linear(x, torch.cat([t["q"], t["k2"], t["v2"]]), stacked_bias),
        "qkv1": F.linear(x, torch.cat([t["q"], t["k1"], t["v1"]])),
    }
    assert_matches(got, expected, exact=set(got))


def _group(rank: int, size: int) -> Any:
    return SimpleNamespace(rank_in_group=rank, world_size=size)


@pytest.fixture
def fake_rank(monkeypatch: pytest.MonkeyPatch) -> Any:
    """Build layers as rank `rank` of `size` (no collectives run: loading only)."""

    def set_rank(rank: int, size: int) -> None:
        for module in (linear, vocab_parallel_embedding):
            monkeypatch.setattr(module, "get_tp_group", lambda: _group(rank, size))

    return set_rank


@pytest.mark.parametrize("rank", [0, 1])
def test_weight_loader_takes_this_ranks_rows_and_columns(fake_rank: Any, rank: int) -> None:
    t = reference_tensors()
    fake_rank(rank, 2)
    layers = build_layers(t)
    assert torch.equal(layers["column"].weight, t["column.weight"][6 * rank : 6 * rank + 6])
    assert torch.equal(layers["row"].weight, t["row.weight"][:, 6 * rank : 6 * rank + 6])
    assert torch.equal(layers["row"].bias, t["row.bias"])  # whole: added once, after the all-reduce
    assert torch.equal(layers["gate_up"].weight, torch.cat([t["gate"][5 * rank : 5 * rank + 5],
                                                            t["up"][5 * rank : 5 * rank + 5]]))
    q_rows = t["q"][8 * rank : 8 * rank + 8]  # 2 of the 4 query heads
    # 2 KV heads: one each; 1 KV head: replicated on both ranks.
    assert torch.equal(layers["qkv2"].weight, torch.cat([q_rows, t["k2"][4 * rank : 4 * rank + 4],
                                                         t["v2"][4 * rank : 4 * rank + 4]]))
    assert torch.equal(layers["qkv1"].weight, torch.cat([q_rows, t["k1"], t["v1"]]))
    start, end, per_rank = vocab_shard(VOCAB, rank, 2)
    assert (start, end, per_rank) == ((0, 6, 6), (6, 11, 6))[rank]
    padded = torch.cat([t["embed"][start:end], torch.zeros(per_rank - (end - start), HIDDEN)])
    assert torch.equal(layers["embed"].weight, padded)
    assert torch.equal(layers["lm_head"].weight, padded)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_kv_heads_replicated_on_the_ranks_of_their_query_heads(fake_rank: Any, rank: int) -> None:
    """8 query heads, 2 KV heads, 4 ranks: rank r holds query heads 2r and
    2r + 1, which (4 per KV head) read KV head r // 2."""
    t = reference_tensors()
    fake_rank(rank, 4)
    q, k, v = torch.randn(8 * HEAD_SIZE, HIDDEN), t["k2"], t["v2"]
    qkv = QKVParallelLinear(HIDDEN, HEAD_SIZE, 8, 2)
    for shard_id, tensor in enumerate((q, k, v)):
        qkv.weight_loader(qkv.weight, tensor, shard_id)
    kv_head = slice(rank // 2 * HEAD_SIZE, (rank // 2 + 1) * HEAD_SIZE)
    assert (qkv.num_heads, qkv.num_kv_heads, qkv.num_kv_head_replicas) == (2, 1, 2)
    q_rows = q[2 * HEAD_SIZE * rank : 2 * HEAD_SIZE * (rank + 1)]
    assert torch.equal(qkv.weight, torch.cat([q_rows, k[kv_head], v[kv_head]]))


def test_heads_that_do_not_divide_are_a_config_error(fake_rank: Any) -> None:
    fake_rank(0, 3)
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel_size=3.*attention heads \(4\)"):
        QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, 2)
    fake_rank(0, 4)
    with pytest.raises(ConfigError, match=r"tensor_parallel_size=4.*multiple of the model's key/value heads \(3\)"):
        QKVParallelLinear(HIDDEN, HEAD_SIZE, 12, 3)
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel_size=4.*input features \(6\)"):
        RowParallelLinear(6, 4)


def test_misshaped_checkpoint_tensor_is_named_in_full_shape(fake_rank: Any) -> None:
    fake_rank(1, 2)
    qkv = QKVParallelLinear(HIDDEN, HEAD_SIZE, NUM_HEADS, 2)
    with pytest.raises(ValueError, match=r"model expects \(8, 8\), checkpoint has \(4, 8\)"):
        qkv.weight_loader(qkv.weight, torch.zeros(4, HIDDEN), 1)


def test_two_ranks_equal_the_full_layers(tmp_path: Path) -> None:
    from helpers.tp_ranks import run_ranks

    results = run_ranks(__file__, 2, tmp_path)
    t = reference_tensors()
    for rank, got in enumerate(results):
        # The embedding only selects rows (plus zeros): exact. A GEMM over a
        # slice of the weight (or an all-reduce of partial products) may
        # block its sums differently from the full GEMM: close.
        assert_matches(got, expected_outputs(t, rank, 2), exact={"embed"})


if __name__ == "__main__":  # one rank of test_two_ranks_equal_the_full_layers
    from helpers.tp_ranks import init_rank_from_argv

    from pagedllm.distributed.parallel_state import destroy_distributed_environment

    tp_rank, tp_size, out_dir, _ = init_rank_from_argv()
    tensors = reference_tensors()
    torch.save(run_layers(build_layers(tensors), tensors, tp_rank, tp_size), out_dir / f"rank{tp_rank}.pt")
    destroy_distributed_environment()
