"""How tensor parallelism splits a model's attention heads over ranks.

The one definition: QKVParallelLinear (linear.py) builds each rank's q/k/v
slice with it, and the Worker sizes each rank's KV cache with it
(`ModelFacts.heads_per_rank`), so a rank's cache and its layers cannot
disagree. Imports no torch: the engine process checks a config with it
before any rank starts.
"""

from __future__ import annotations

from typing import NamedTuple

from pagedllm.core.errors import ConfigError

TP_SIZE_FIELD = "parallel.tensor_parallel_size"


def divide(numerator: int, tp_size: int, what: str) -> int:
    """numerator // tp_size; a ConfigError naming `what` when it does not divide."""
    if numerator % tp_size != 0:
        raise ConfigError(TP_SIZE_FIELD, tp_size, f"a divisor of the model's {what} ({numerator})")
    return numerator // tp_size


class HeadPartition(NamedTuple):
    """One rank's share of a model's attention heads."""

    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (its KV cache holds these)
    num_kv_head_replicas: int  # ranks holding each KV head (1: not replicated)


def partition_heads(total_num_heads: int, total_num_kv_heads: int, tp_size: int) -> HeadPartition:
    """Query heads split evenly; KV heads split evenly, or (fewer KV heads
    than ranks) one per rank, each replicated on tp / num_kv_heads ranks.
    A ConfigError on `parallel.tensor_parallel_size` when neither fits."""
    num_heads = divide(total_num_heads, tp_size, "attention heads")
    if total_num_kv_heads % tp_size == 0:
        return HeadPartition(num_heads, total_num_kv_heads // tp_size, 1)
    if tp_size % total_num_kv_heads == 0:
        return HeadPartition(num_heads, 1, tp_size // total_num_kv_heads)
    raise ConfigError(
        TP_SIZE_FIELD, tp_size, f"a divisor or a multiple of the model's key/value heads ({total_num_kv_heads})"
    )
