"""The KV connector interface, modeled on vLLM's `KVConnectorBase_V1`.

A connector moves KV blocks (16 tokens with a content hash, the prefix
cache's unit) between this engine's paged cache and somewhere else: another
engine through shared storage, a CPU-memory tier, a remote store. One class
serves two roles (vLLM's `KVConnectorRole`), and `context.side` says which an
instance serves: "scheduler" (one instance, built by the engine builder and
owned by the scheduler) or "worker" (one instance per rank, built by that
rank over its shard of every block: its KV heads). Every executor (`uni`,
`mp`, `ray`) builds them the same way, so a connector never finds both
roles in one instance (even with `uni`, where both live in one process).

Scheduler side, in the order the scheduler calls them:
- `get_num_new_matched_tokens(request, num_computed_tokens)`: how many tokens
  past the local prefix-cache hit the connector can load (None: ask again
  next step, e.g. while a transfer is still arriving);
- `update_state_after_alloc(request, block_ids, num_external_tokens)`: the
  request got blocks; remember which ones to load into;
- `build_connector_meta(scheduler_output)`: everything the worker side needs
  this step (blocks to load, to save, to spill), handed over with the step.
  At tensor_parallel_size > 1 it is sent to every rank as msgpack: plain data
  (block ids, hashes, numbers, strings) in a dataclass, `metadata_cls`, never
  tensors; each rank moves its own shard;
- `request_finished(request, block_ids)`: True keeps the blocks allocated
  until every rank's `get_finished` has reported the request's save done.

Worker side, around the model forward of the step:
- `register_kv_caches(kv_caches)` once at start-up;
- `start_load_kv(metadata)` before the forward; `wait_for_layer_load(i)`
  before layer i reads its cache;
- `save_kv_layer(i, ...)` after layer i wrote its cache; `wait_for_save()`
  at the end of the step;
- `get_finished(finished_req_ids)`, after every step (also one that ran no
  tokens): the requests finished since the last step are named once; it
  answers with the requests whose delayed save / async load is now done.
  Its answer and the worker side's `stats` (what it loaded and saved) reach
  the scheduler with the step's output (`KVConnectorOutput`), summed over
  the ranks; so do the figures of its `get_custom_stats()`, if it declares
  `custom_metrics` (core/custom_stats.py).

The connector's counts are the scheduler side's `stats` plus what the
worker sides reported: `Scheduler.kv_connector_stats` (and the engine's
metrics) add them up; one instance's `stats` holds only its own role's.

A failed load is the connector's to detect (checksums, sizes), on the
scheduler side: under `load_failure_policy: recompute` it simply reports
fewer matched tokens; under `fail` it raises `KVTransferError`, which fails
that request alone.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import msgspec

from pagedllm.attention_backends.base import STANDARD_KV_CACHE_LAYOUT, KVCacheLayout

# NOTE: defined beside SchedulerOutput and ModelRunnerOutput, which carry
# them; the plugin API names them here, so connectors import them from this module.
from pagedllm.core.scheduler_output import KVConnectorMetadata as KVConnectorMetadata
from pagedllm.core.scheduler_output import KVConnectorOutput as KVConnectorOutput
from pagedllm.core.scheduler_output import KVConnectorStats as KVConnectorStats

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import KVTransferConfig
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import SchedulerOutput


def model_fingerprint(
    model_path: str,
    dtype: torch.dtype,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    quantization: str | None = None,
    kv_cache_dtype: torch.dtype | None = None,
    latent: bool = False,
) -> str:
    """A short name for "these KV blocks are interchangeable": the model's
    config.json, its weight files' names and sizes, the dtype, the cache
    layout and the tensor-parallel layout (a rank's blocks hold only its KV
    heads: a TP=2 rank never loads TP=1 blocks, nor another rank's) and the
    quantization method (its weights compute other keys and values) and the
    KV cache's storage dtype where it is not `dtype` (an fp8 cache's blocks
    never load into a bfloat16 one, nor the other way), and the page's
    layout where it is the latent (MLA) one: one vector of `head_size` per
    token, the same on every rank.
    (Weights are not read: sizes stand in for a checksum, so two
    checkpoints of one architecture with equal file sizes must not share
    a directory.)"""
    import hashlib
    from pathlib import Path

    digest = hashlib.sha256()
    folder = Path(model_path)
    config_file = folder / "config.json"
    digest.update(config_file.read_bytes() if config_file.is_file() else str(model_path).encode())
    if folder.is_dir():
        for weights in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
            digest.update(f"{weights.name}:{weights.stat().st_size};".encode())
    elif folder.suffix == ".gguf" and folder.is_file():  # one file: config and weights
        digest.update(f"{folder.name}:{folder.stat().st_size};".encode())
    digest.update(f"{dtype}|{block_size}|{num_layers}|{num_kv_heads}|{head_size}".encode())
    if tp_size > 1:  # NOTE: TP=1 fingerprints (and the blocks stored under them) stay as they were
        digest.update(f"|tp={tp_size}|rank={tp_rank}".encode())
    if quantization is not None:  # other weights, other keys and values
        digest.update(f"|quantization={quantization}".encode())
    if kv_cache_dtype is not None and kv_cache_dtype != dtype:  # NOTE: "auto" caches keep their fingerprint
        digest.update(f"|kv_cache_dtype={kv_cache_dtype}".encode())
    if latent:  # NOTE: per-head K/V caches keep their fingerprint
        digest.update(b"|layout=mla")
    return digest.hexdigest()[:16]


class KVConnectorRole(enum.StrEnum):
    """Which side a connector instance serves (`KVConnectorContext.side`)."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorShard(msgspec.Struct, frozen=True):
    """What a rank holds of every block, as its connector's scheduler side
    must know it: the builder asks each rank (`Worker.kv_connector_shard`)."""

    fingerprint: str  # the rank's `model_fingerprint`
    num_layers: int
    num_kv_heads: int  # the rank's


@dataclass(frozen=True)
class KVConnectorContext:
    """The engine facts a connector needs to lay out and name blocks."""

    model_path: str
    # Identifies models whose KV blocks are interchangeable (architecture,
    # weights, dtype, layout); stored blocks are kept apart by it.
    model_fingerprint: str
    block_size: int
    num_layers: int
    num_kv_heads: int  # this rank's (all of the model's at tensor_parallel_size 1)
    head_size: int
    dtype: torch.dtype  # the KV cache's (cache.cache_dtype resolved; fp8 or the compute dtype)
    device: torch.device
    # The attention backend's: connectors read and write blocks through it
    # (kv_connectors/block_io.py), never assuming the cache's shape.
    kv_cache_layout: KVCacheLayout = STANDARD_KV_CACHE_LAYOUT
    # Which side this instance serves (a KVConnectorRole): the engine builds a
    # "scheduler" side and a "worker" side per rank. "both" (the default) is
    # left for contexts made by hand, e.g. a connector's own unit tests.
    side: str = "both"
    tp_size: int = 1
    tp_rank: int = 0  # a worker side's rank (the scheduler side's is 0)
    # Every rank's fingerprint, in rank order (a scheduler side checks that
    # each rank's shard of a block is there); () means (model_fingerprint,).
    rank_fingerprints: tuple[str, ...] = ()

    @property
    def shard_fingerprints(self) -> tuple[str, ...]:
        """The fingerprints of the shards this side deals with: every
        rank's on the scheduler side, this rank's on a worker side."""
        if self.side == "scheduler" and self.rank_fingerprints:
            return self.rank_fingerprints
        return (self.model_fingerprint,)


class KVConnectorBase(ABC):
    # What build_connector_meta returns: a rank decodes the step's metadata
    # into it (at tensor_parallel_size > 1 it crosses a process boundary).
    metadata_cls: ClassVar[type[KVConnectorMetadata]] = KVConnectorMetadata
    # Whether the scheduler reports prefix-cache evictions (a block's cached
    # contents about to be overwritten) through `on_blocks_evicted`.
    wants_eviction_events: ClassVar[bool] = False

    def __init__(self, config: KVTransferConfig, context: KVConnectorContext) -> None:
        self.config = config
        self.context = context
        self.stats = KVConnectorStats()
        self.kv_caches: list[torch.Tensor] = []

    @property
    def is_producer(self) -> bool:
        return self.config.role in ("producer", "both")

    @property
    def is_consumer(self) -> bool:
        return self.config.role in ("consumer", "both")

    # ------------------------------------------------------ scheduler side

    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Tokens after `num_computed_tokens` (a multiple of the block size:
        the local hit) the connector will load for `request`; at most up to
        `request.num_tokens - 1` (the last prompt token is always computed).
        None: not decidable yet; the scheduler asks again next step."""

    def on_blocks_evicted(self, evicted: list[tuple[int, bytes]]) -> None:  # noqa: B027 - optional: the default does nothing
        """(block id, block hash) of cached blocks this step's allocations
        reuse; their old contents stay intact until this step's forward.
        Called only when `wants_eviction_events`."""

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:  # noqa: B027 - optional: the default does nothing
        """`request` holds `block_ids` (its whole table); the
        `num_external_tokens` after its local hit are to be loaded."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The worker side's instructions for the step being scheduled."""

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        """`request` finished holding `block_ids`. True: do not free them
        until `get_finished` lists the request (a save still reads them)."""
        return False

    # --------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The engine's per-layer caches, each laid out as `context.kv_cache_layout`."""
        self.kv_caches = kv_caches

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:  # noqa: B027 - optional: the default does nothing
        """Begin (or do) this step's loads into the paged cache."""

    def wait_for_layer_load(self, layer_index: int) -> None:  # noqa: B027 - optional: the default does nothing
        """Return once layer `layer_index`'s loads are in its cache."""

    def save_kv_layer(self, layer_index: int, kv_cache: torch.Tensor, metadata: KVConnectorMetadata) -> None:  # noqa: B027 - optional: the default does nothing
        """Layer `layer_index` computed this step's K/V into `kv_cache`."""

    def wait_for_save(self) -> None:  # noqa: B027 - optional: the default does nothing
        """Return once this step's saves no longer need the paged cache."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        """After every step: `finished_req_ids` finished since the last
        call (each named once; a request whose `request_finished` returned
        True is among them). Returns (requests whose delayed save is done,
        requests whose async load is done) since the last call."""
        return set(), set()

    def describe(self) -> dict[str, Any]:
        """For logs and `/server_info`."""
        return {"connector": self.config.connector, "role": self.config.role}
