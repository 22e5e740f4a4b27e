"""shared_storage: KV blocks as files in a directory several engines share.

A producer writes every full prompt block it computes to
`<extra.path>/<model fingerprint>/<block hash>.safetensors` (one tensor
[num_layers, 2, block_size, Hkv, D] and its SHA-256 in the metadata), written
to a temporary name and renamed, so a reader never sees half a file. A
consumer with the same model, at scheduling time, walks the request's block
hashes past its local prefix-cache hit and takes each block whose file
exists, reads whole and matches its checksum and shape; the worker side
reads those files into the request's newly allocated blocks before the
forward, and those tokens are never computed. Because block hashes chain over
the whole prefix, a hit on block i means the same tokens (and salt) in blocks
0..i.

At tensor_parallel_size > 1 a block is one file per rank (its KV heads), in
that rank's directory (its fingerprint names the tensor-parallel layout and
the rank): each rank writes and reads its own, and the scheduler side takes a
block only when every rank's file checks out.

Two `pagedllm serve` instances sharing the directory are disaggregated
prefill on one machine (`pagedllm disagg-proxy` routes requests).
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedllm.core.errors import ConfigError, KVTransferError
from pagedllm.kv_connectors.base import KVConnectorBase, KVConnectorContext, KVConnectorMetadata
from pagedllm.kv_connectors.block_io import block_shape, gather_blocks, scatter_blocks

if TYPE_CHECKING:
    from pagedllm.core.config import KVTransferConfig
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler_output import SchedulerOutput

logger = logging.getLogger(__name__)

TIER = "shared_storage"


@dataclass
class SharedStorageMetadata(KVConnectorMetadata):
    # (block id, block hash) of stored blocks to read in before the forward.
    loads: list[tuple[int, bytes]] = field(default_factory=list)
    # (block id, block hash) computed by this step, to store after the forward.
    saves: list[tuple[int, bytes]] = field(default_factory=list)


@dataclass
class _Tracked:
    request: Request
    block_ids: list[int]


def read_block(path: Path, expected_shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The block stored at `path`; ValueError (with the reason) if it is
    missing, truncated, corrupted or of another layout."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError("missing") from None
    try:
        tensors = load(data)
    except (SafetensorError, ValueError, RuntimeError) as exc:
        raise ValueError(f"unreadable ({exc})") from None
    block = tensors.get("kv")
    if block is None or tuple(block.shape) != expected_shape or block.dtype != dtype:
        found = None if block is None else (tuple(block.shape), str(block.dtype))
        raise ValueError(f"layout {found} != expected {(expected_shape, str(dtype))}")
    metadata = _metadata(data)
    if metadata.get("sha256") != hashlib.sha256(_tensor_bytes(block)).hexdigest():
        raise ValueError("checksum mismatch (corrupted)")
    return block


def write_block(path: Path, block: torch.Tensor) -> int:
    """Store `block` at `path` atomically; returns the bytes written."""
    from safetensors.torch import save

    block = block.contiguous()
    data = save({"kv": block}, metadata={"sha256": hashlib.sha256(_tensor_bytes(block)).hexdigest()})
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    return len(data)


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().view(torch.uint8).numpy().tobytes()


def _metadata(data: bytes) -> dict[str, str]:
    import json

    header_len = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + header_len])
    return dict(header.get("__metadata__", {}))


class SharedStorageConnector(KVConnectorBase):
    metadata_cls = SharedStorageMetadata

    def __init__(self, config: KVTransferConfig, context: KVConnectorContext) -> None:
        super().__init__(config, context)
        context.kv_cache_layout.ensure_blocks_movable()
        path = config.extra.get("path")
        if not path:
            raise ConfigError("kv_transfer.extra.path", path, "a directory every producer and consumer can reach")
        # One per shard this side deals with (every rank's on the scheduler side).
        self.directories = [Path(path) / fingerprint for fingerprint in context.shard_fingerprints]
        for directory in self.directories:
            directory.mkdir(parents=True, exist_ok=True)
        self.directory = self.directories[0]
        self.block_shape = block_shape(context.num_layers, context.block_size, context.num_kv_heads, context.head_size,
                                       context.kv_cache_layout)
        self._tracked: dict[str, _Tracked] = {}
        # Found by get_num_new_matched_tokens, placed by update_state_after_alloc.
        self._found: dict[str, tuple[int, list[bytes]]] = {}
        self._loads: list[tuple[int, bytes]] = []
        self._metadata = SharedStorageMetadata()

    def block_path(self, block_hash: bytes, shard: int = 0) -> Path:
        return self.directories[shard] / f"{block_hash.hex()}.safetensors"

    def _is_stored(self, block_hash: bytes, shards: str = "all") -> bool:
        paths = (self.block_path(block_hash, shard).exists() for shard in range(len(self.directories)))
        return all(paths) if shards == "all" else any(paths)

    def _check_stored(self, block_hash: bytes) -> int:
        """Bytes of the block's every shard, read whole and verified;
        ValueError (with the reason) if one is bad."""
        num_bytes = 0
        for shard in range(len(self.directories)):
            try:
                block = read_block(self.block_path(block_hash, shard), self.block_shape, self.context.dtype)
            except ValueError as exc:
                raise ValueError(f"{exc} (rank {shard}'s shard)" if len(self.directories) > 1 else str(exc)) from None
            num_bytes += block.numel() * block.element_size()
        return num_bytes

    # ------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        self._found.pop(request.request_id, None)
        if not self.is_consumer:
            return 0
        block_size = self.context.block_size
        first_block = num_computed_tokens // block_size
        max_blocks = (request.num_tokens - 1) // block_size  # the last token is computed here
        found: list[bytes] = []
        last_block = min(max_blocks, len(request.block_hashes))
        for index in range(first_block, last_block):
            block_hash = request.block_hashes[index]
            try:
                if not self._is_stored(block_hash, "any"):
                    # A producer stores every full block of a prompt, so a
                    # gap before a stored later block is a lost file; else
                    # the prefix simply ends here.
                    later = request.block_hashes[index + 1 : last_block]
                    if not any(self._is_stored(h, "any") for h in later):
                        self.stats.count("tier_misses", TIER)
                        break
                    raise ValueError("missing (a later block of the same prefix is stored)")
                num_bytes = self._check_stored(block_hash)
            except ValueError as exc:
                self.stats.load_failures += 1
                if self.config.load_failure_policy == "fail":
                    raise KVTransferError(TIER, block_hash.hex(), str(exc)) from None
                logger.warning("recomputing from block %s of %s: %s", index, request.request_id, exc)
                break
            found.append(block_hash)
            self.stats.count("tier_hits", TIER)
            self.stats.count("tier_bytes_loaded", TIER, num_bytes)
        self.stats.external_queries += request.num_tokens
        self.stats.external_hits += len(found) * block_size
        if found:
            self._found[request.request_id] = (first_block, found)
        return len(found) * block_size

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        self._tracked[request.request_id] = _Tracked(request, list(block_ids))
        found = self._found.pop(request.request_id, None)
        if found is None or num_external_tokens == 0:
            return
        first_block, hashes = found
        for offset, block_hash in enumerate(hashes[: num_external_tokens // self.context.block_size]):
            self._loads.append((block_ids[first_block + offset], block_hash))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> SharedStorageMetadata:
        for cached in scheduler_output.scheduled_cached_reqs:
            tracked = self._tracked.get(cached.req_id)
            if tracked is not None and not cached.resumed_from_preemption:
                tracked.block_ids.extend(cached.new_block_ids)
        saves: list[tuple[int, bytes]] = []
        if self.is_producer:
            block_size = self.context.block_size
            for req_id, num_new_tokens in scheduler_output.num_scheduled_tokens.items():
                tracked = self._tracked.get(req_id)
                if tracked is None:
                    continue
                request = tracked.request
                # Full prompt blocks this step completes (the scheduler has
                # not advanced num_computed_tokens yet).
                start = request.num_computed_tokens
                end = min(start + num_new_tokens, request.num_prompt_tokens)
                for index in range(start // block_size, min(end // block_size, len(request.block_hashes))):
                    block_hash = request.block_hashes[index]
                    if not self._is_stored(block_hash):
                        saves.append((tracked.block_ids[index], block_hash))
        loads, self._loads = self._loads, []
        return SharedStorageMetadata(loads=loads, saves=saves)

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        self._tracked.pop(request.request_id, None)
        self._found.pop(request.request_id, None)
        return False  # saves are written within the step that computed them

    # --------------------------------------------------------- worker side

    def start_load_kv(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, SharedStorageMetadata)
        self._metadata = metadata
        if not metadata.loads:
            return
        blocks = []
        for _, block_hash in metadata.loads:
            try:
                blocks.append(read_block(self.block_path(block_hash), self.block_shape, self.context.dtype))
            except ValueError as exc:
                # NOTE: the scheduler side read it whole this step; only a
                # file removed or rewritten since gets here, and the step fails.
                raise KVTransferError(TIER, block_hash.hex(), f"{exc} since it was scheduled") from None
        block_ids = [block_id for block_id, _ in metadata.loads]
        scatter_blocks(self.kv_caches, block_ids, torch.stack(blocks), self.context.kv_cache_layout)

    def wait_for_save(self) -> None:
        saves, self._metadata = self._metadata.saves, SharedStorageMetadata()
        if not saves:
            return
        blocks = gather_blocks(self.kv_caches, [block_id for block_id, _ in saves], self.context.kv_cache_layout)
        for (_, block_hash), block in zip(saves, blocks, strict=True):
            path = self.block_path(block_hash)
            if not path.exists():  # another rank's shard was missing, not this one
                self.stats.count("tier_bytes_saved", TIER, write_block(path, block))

    def describe(self) -> dict[str, object]:
        return {**super().describe(), "path": str(self.directory), "shards": len(self.directories)}
