"""Vocabulary-parallel embedding and LM head (vLLM's names).

The vocabulary is cut into tp contiguous ranges of ceil(vocab / tp) rows;
rank r holds rows [r * per_rank, min((r + 1) * per_rank, vocab)), and the last
rank's range is padded with zero rows up to per_rank so every rank's shard
has one shape (the padded logits are dropped by the LogitsHead). At
world size 1 there is no padding: the shard is the whole table.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.parallel_state import get_tp_group
from pagedllm.model_registry.layers.linear import LinearBase, copy_shard


class VocabShard(NamedTuple):
    start: int  # first vocabulary id of this rank
    end: int  # one past the last real id of this rank (<= start + per_rank)
    per_rank: int  # rows per rank, padding included


def vocab_shard(vocab_size: int, tp_rank: int, tp_size: int) -> VocabShard:
    per_rank = -(-vocab_size // tp_size)
    start = min(tp_rank * per_rank, vocab_size)
    return VocabShard(start, min(start + per_rank, vocab_size), per_rank)


def load_vocab_shard(param: torch.Tensor, loaded_weight: torch.Tensor, shard: VocabShard, vocab_size: int) -> None:
    """This rank's rows of the full [vocab, hidden] table; padding rows zero."""
    num_rows = shard.end - shard.start
    copy_shard(param.data.narrow(0, 0, num_rows), loaded_weight, 0, shard.start, vocab_size)
    with torch.no_grad():
        param.data[num_rows:].zero_()


class VocabParallelEmbedding(nn.Module):
    """Rank r looks up the ids in its range; ids outside it give zero rows,
    and one all-reduce sums the ranks' rows into the full embedding."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.tp_group = get_tp_group()
        self.tp_size = self.tp_group.world_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.shard = vocab_shard(num_embeddings, self.tp_group.rank_in_group, self.tp_size)
        self.weight = nn.Parameter(torch.empty(self.shard.per_rank, embedding_dim))
        nn.init.normal_(self.weight)  # nn.Embedding's init; the checkpoint overwrites it
        self.weight.weight_loader = self.weight_loader  # type: ignore[attr-defined]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        load_vocab_shard(param, loaded_weight, self.shard, self.num_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.shard.start) | (input_ids >= self.shard.end)
        local_ids = (input_ids - self.shard.start).masked_fill(outside, 0)
        embeddings = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return self.tp_group.all_reduce(embeddings)


class ParallelLMHead(LinearBase):
    """The output projection hidden -> this rank's vocabulary range: an
    ``nn.Linear`` of [per_rank, hidden] (so a platform's GEMM swap applies),
    sharded like VocabParallelEmbedding so a tied head shares its weight.
    Applied by LogitsHead, which gathers the ranks' logits."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        tp_group = get_tp_group()
        shard = vocab_shard(num_embeddings, tp_group.rank_in_group, tp_group.world_size)
        super().__init__(embedding_dim, shard.per_rank, bias=False)
        self.num_embeddings = num_embeddings
        self.shard = shard

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        load_vocab_shard(param, loaded_weight, self.shard, self.num_embeddings)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead holds one rank's vocabulary; use LogitsHead(lm_head, hidden_states)")
