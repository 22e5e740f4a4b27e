"""What each replica's prefix cache holds, mirrored from its KV events, and
how much of a prompt it holds.

A prompt's full blocks are hashed the way the engines hash them (chained
from the first block, the cache salt in the first, an adapter request's
content digest in every one), so a replica holds a
prefix of k blocks exactly when it holds the first k hashes. As in the
engine, the prompt's last token is always computed: a prompt of whole blocks
can hit all blocks but its last.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagedllm.core.kv_cache.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from pagedllm.core.kv_cache.hashing import block_extra_keys, get_hash_fn, hash_block_tokens
from pagedllm.core.request import BlockHash


class ReplicaCacheMirror:
    """The block hashes one replica's prefix cache holds, as its events say."""

    def __init__(self) -> None:
        self.block_hashes: set[bytes] = set()

    def apply(self, events: Iterable[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self.block_hashes.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.block_hashes.difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.block_hashes.clear()

    def num_cached_blocks(self, prompt_block_hashes: Sequence[BlockHash]) -> int:
        """How many of the prompt's leading blocks this replica holds."""
        for index, block_hash in enumerate(prompt_block_hashes):
            if block_hash not in self.block_hashes:
                return index
        return len(prompt_block_hashes)


class PromptHasher:
    """A prompt's hittable blocks' hashes, as every replica's prefix cache
    names them (the engines' block size and hash algorithm)."""

    def __init__(self, block_size: int, hash_algo: str) -> None:
        self.block_size = block_size
        self.hash_fn = get_hash_fn(hash_algo)

    def __call__(
        self, prompt_token_ids: Sequence[int], cache_salt: str | None, lora_digest: str | None = None
    ) -> list[BlockHash]:
        """`lora_digest`: the adapter's content digest (core/lora.py), which
        enters every block hash as in the engines; None for the base model.
        NOTE: never the adapter's name: the same name may stand for other
        weights after a reload, and then shares no block."""
        # The engine computes a prompt's last token whatever it holds.
        num_blocks = (len(prompt_token_ids) - 1) // self.block_size if prompt_token_ids else 0
        hashes: list[BlockHash] = []
        parent: BlockHash | None = None
        for index in range(num_blocks):
            tokens = prompt_token_ids[index * self.block_size : (index + 1) * self.block_size]
            parent = hash_block_tokens(
                self.hash_fn, parent, tokens, block_extra_keys(index, cache_salt=cache_salt, lora_digest=lora_digest)
            )
            hashes.append(parent)
        return hashes


__all__ = ["PromptHasher", "ReplicaCacheMirror"]
