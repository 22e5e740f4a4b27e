"""Chained block hashes for prefix caching.

A block's identity is hash(parent_block_hash, token_ids, extra_keys) over a
canonical, type-tagged byte serialization. Never Python's hash() (salted per
process) nor pickle (not canonical): a later issue moves blocks between
engines keyed by these hashes, so the same tokens must give the same bytes in
every process on every machine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.request import BlockHash

if TYPE_CHECKING:
    from pagedllm.core.request import Request

HashFn = Callable[[bytes], bytes]

# NOTE: the root of every chain. Changing it invalidates every stored hash.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pagedllm").digest()

# Extra-key source tags; a tag is part of the serialized key, so a LoRA named X
# and a salt X can never produce the same hash.
SALT_KEY = "salt"
LORA_KEY = "lora"


def sha256_hash(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def xxhash_hash(data: bytes) -> bytes:
    import xxhash  # optional speed-up; imported only when selected

    return xxhash.xxh3_128_digest(data)


_HASH_FNS: dict[str, HashFn] = {"sha256": sha256_hash, "xxhash": xxhash_hash}


def get_hash_fn(algo: str) -> HashFn:
    """The block hash function for `prefix_caching_hash_algo`."""
    try:
        return _HASH_FNS[algo]
    except KeyError:
        raise ConfigError(
            key="prefix_caching_hash_algo", value=algo, allowed=" | ".join(sorted(_HASH_FNS))
        ) from None


def _len_prefix(n: int) -> bytes:
    return struct.pack("<Q", n)


def _serialize(value: Any, out: bytearray) -> None:
    """Type-tagged, length-prefixed encoding: distinct values never share bytes."""
    # NOTE: bool before int (bool is an int subclass).
    if value is None:
        out += b"N"
    elif isinstance(value, bool):
        out += b"T" if value else b"F"
    elif isinstance(value, int):
        digits = str(value).encode("ascii")
        out += b"i" + _len_prefix(len(digits)) + digits
    elif isinstance(value, str):
        data = value.encode("utf-8")
        out += b"s" + _len_prefix(len(data)) + data
    elif isinstance(value, (bytes, bytearray)):
        out += b"b" + _len_prefix(len(value)) + bytes(value)
    elif isinstance(value, (tuple, list)):
        out += b"t" + _len_prefix(len(value))
        for item in value:
            _serialize(item, out)
    else:
        raise TypeError(f"cannot hash extra key of type {type(value).__name__}: {value!r}")


def hash_block_tokens(
    hash_fn: HashFn,
    parent_block_hash: BlockHash | None,
    curr_block_token_ids: Sequence[int],
    extra_keys: tuple[Any, ...] | None = None,
) -> BlockHash:
    """Hash of one full block, chained on its parent (None for the first block)."""
    parent = ROOT_BLOCK_HASH if parent_block_hash is None else parent_block_hash
    out = bytearray(b"pagedllm-block-v1")
    out += b"b" + _len_prefix(len(parent)) + parent
    # Token ids as fixed-width little-endian int64: fast and canonical.
    out += b"L" + _len_prefix(len(curr_block_token_ids))
    out += struct.pack(f"<{len(curr_block_token_ids)}q", *curr_block_token_ids)
    _serialize(extra_keys, out)
    return hash_fn(bytes(out))


def generate_block_hash_extra_keys(request: Request, block_index: int) -> tuple[Any, ...] | None:
    """Tagged extra keys of block `block_index` of `request`."""
    lora_digest = None if request.lora is None else request.lora.digest
    return block_extra_keys(block_index, cache_salt=request.cache_salt, lora_digest=lora_digest)


def block_extra_keys(
    block_index: int, *, cache_salt: str | None = None, lora_digest: str | None = None
) -> tuple[Any, ...] | None:
    """Tagged extra keys of block `block_index` of a prompt (a router hashes
    prompts with it, without a Request).

    The salt goes on the first block only: the chain carries it to every later
    block. The adapter's content digest (core/lora.py; never its name or path)
    goes on every block because an adapter changes the K/V of each position.
    """
    keys: list[tuple[str, Any]] = []
    if lora_digest is not None:
        keys.append((LORA_KEY, lora_digest))
    if block_index == 0 and cache_salt is not None:
        keys.append((SALT_KEY, cache_salt))
    return tuple(keys) if keys else None


def get_request_block_hasher(block_size: int, hash_fn: HashFn) -> Callable[[Request], list[BlockHash]]:
    """A callable that appends to `request.block_hashes` the hashes of the full
    blocks of `request.all_token_ids` not hashed yet, and returns the new ones."""

    def request_block_hasher(request: Request) -> list[BlockHash]:
        block_hashes = request.block_hashes
        start = len(block_hashes)
        num_full_blocks = request.num_tokens // block_size
        if start >= num_full_blocks:
            return []
        token_ids = request.all_token_ids
        parent = block_hashes[-1] if block_hashes else None
        new_hashes: list[BlockHash] = []
        for block_index in range(start, num_full_blocks):
            begin = block_index * block_size
            parent = hash_block_tokens(
                hash_fn,
                parent,
                token_ids[begin : begin + block_size],
                generate_block_hash_extra_keys(request, block_index),
            )
            new_hashes.append(parent)
        block_hashes.extend(new_hashes)
        return new_hashes

    return request_block_hasher
