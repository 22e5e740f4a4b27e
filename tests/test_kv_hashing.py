from __future__ import annotations

import hashlib
import struct
import subprocess
import sys
from types import SimpleNamespace

import pytest
import xxhash

from pagedllm.core.errors import ConfigError
from pagedllm.core.kv_cache.hashing import (
    ROOT_BLOCK_HASH,
    generate_block_hash_extra_keys,
    get_hash_fn,
    get_request_block_hasher,
    hash_block_tokens,
)
from pagedllm.core.lora import LoRARef
from pagedllm.core.request import Request

SHA256 = get_hash_fn("sha256")


def make_request(request_id: str, token_ids: list[int], **kwargs: object) -> Request:
    params = SimpleNamespace(prompt_logprobs=None, structured_outputs=None)
    return Request(request_id, token_ids, params, eos_token_id=None, **kwargs)


def reference_block_bytes(parent: bytes, token_ids: list[int]) -> bytes:
    # The documented canonical layout, rebuilt independently of the module.
    return (
        b"pagedllm-block-v1"
        + b"b"
        + struct.pack("<Q", len(parent))
        + parent
        + b"L"
        + struct.pack("<Q", len(token_ids))
        + b"".join(struct.pack("<q", t) for t in token_ids)
        + b"N"
    )


def test_root_is_sha256_of_project_name() -> None:
    assert hashlib.sha256(b"pagedllm").digest() == ROOT_BLOCK_HASH


def test_block_hash_matches_canonical_serialization() -> None:
    first = hash_block_tokens(SHA256, None, [1, 2, 3, 4])
    assert first == hashlib.sha256(reference_block_bytes(ROOT_BLOCK_HASH, [1, 2, 3, 4])).digest()
    second = hash_block_tokens(SHA256, first, [5, 6, 7, 8])
    assert second == hashlib.sha256(reference_block_bytes(first, [5, 6, 7, 8])).digest()


def test_same_tokens_same_parent_same_hash() -> None:
    parent = hash_block_tokens(SHA256, None, [9, 9, 9, 9])
    assert hash_block_tokens(SHA256, parent, [1, 2, 3, 4]) == hash_block_tokens(SHA256, parent, (1, 2, 3, 4))


def test_different_parent_gives_different_hash() -> None:
    parent_a = hash_block_tokens(SHA256, None, [1, 1, 1, 1])
    parent_b = hash_block_tokens(SHA256, None, [2, 2, 2, 2])
    assert hash_block_tokens(SHA256, parent_a, [5, 6, 7, 8]) != hash_block_tokens(SHA256, parent_b, [5, 6, 7, 8])
    assert hash_block_tokens(SHA256, None, [5, 6, 7, 8]) != hash_block_tokens(SHA256, parent_a, [5, 6, 7, 8])


def test_different_tokens_give_different_hash() -> None:
    assert hash_block_tokens(SHA256, None, [1, 2, 3, 4]) != hash_block_tokens(SHA256, None, [1, 2, 3, 5])
    assert hash_block_tokens(SHA256, None, [1, 2, 3, 4]) != hash_block_tokens(SHA256, None, [4, 3, 2, 1])


def test_extra_keys_are_type_tagged() -> None:
    assert hash_block_tokens(SHA256, None, [1], (("x", 1),)) != hash_block_tokens(SHA256, None, [1], (("x", "1"),))
    assert hash_block_tokens(SHA256, None, [1], (("ab", "c"),)) != hash_block_tokens(SHA256, None, [1], (("a", "bc"),))
    assert hash_block_tokens(SHA256, None, [1], None) != hash_block_tokens(SHA256, None, [1], ())


def test_unsupported_extra_key_type_is_rejected() -> None:
    with pytest.raises(TypeError, match="float"):
        hash_block_tokens(SHA256, None, [1], (("x", 1.5),))


def test_hasher_hashes_only_full_blocks_incrementally() -> None:
    hasher = get_request_block_hasher(4, SHA256)
    request = make_request("r", list(range(10)))
    new_hashes = hasher(request)
    assert len(request.block_hashes) == 2 and new_hashes == request.block_hashes
    first_two = list(request.block_hashes)
    assert first_two[0] == hash_block_tokens(SHA256, None, [0, 1, 2, 3])
    assert first_two[1] == hash_block_tokens(SHA256, first_two[0], [4, 5, 6, 7])

    request.append_output_token_ids(10)  # 11 tokens: still 2 full blocks
    assert hasher(request) == [] and request.block_hashes == first_two
    request.append_output_token_ids(11)  # 12 tokens: the third block is full
    assert hasher(request) == [hash_block_tokens(SHA256, first_two[1], [8, 9, 10, 11])]
    assert request.block_hashes[:2] == first_two


def test_salt_changes_the_whole_chain() -> None:
    hasher = get_request_block_hasher(4, SHA256)
    tokens = list(range(12))
    plain, salted, salted_again, other_salt = (
        make_request("a", tokens),
        make_request("b", tokens, cache_salt="s1"),
        make_request("c", tokens, cache_salt="s1"),
        make_request("d", tokens, cache_salt="s2"),
    )
    for request in (plain, salted, salted_again, other_salt):
        hasher(request)
    assert salted.block_hashes == salted_again.block_hashes
    # The salt is a key of block 0 only, yet every later block differs too.
    for index in range(3):
        assert len({plain.block_hashes[index], salted.block_hashes[index], other_salt.block_hashes[index]}) == 3
    assert generate_block_hash_extra_keys(salted, 0) == (("salt", "s1"),)
    assert generate_block_hash_extra_keys(salted, 1) is None


def test_lora_key_on_every_block_and_never_equal_to_salt() -> None:
    hasher = get_request_block_hasher(4, SHA256)
    tokens = list(range(8))
    lora_x = make_request("a", tokens, lora=LoRARef("name", "X", "/p"))
    salt_x = make_request("b", tokens, cache_salt="X")
    hasher(lora_x)
    hasher(salt_x)
    assert generate_block_hash_extra_keys(lora_x, 0) == (("lora", "X"),)
    assert generate_block_hash_extra_keys(lora_x, 1) == (("lora", "X"),)
    assert lora_x.block_hashes[0] != salt_x.block_hashes[0]
    assert lora_x.block_hashes[1] != salt_x.block_hashes[1]
    both = make_request("c", tokens, lora=LoRARef("name", "X", "/p"), cache_salt="X")
    assert generate_block_hash_extra_keys(both, 0) == (("lora", "X"), ("salt", "X"))


def test_lora_key_is_the_digest_not_the_name_or_path() -> None:
    hasher = get_request_block_hasher(4, SHA256)
    tokens = list(range(8))
    first = make_request("a", tokens, lora=LoRARef("sql", "digest-1", "/adapters/sql"))
    renamed = make_request("b", tokens, lora=LoRARef("other-name", "digest-1", "/elsewhere"))
    reloaded = make_request("c", tokens, lora=LoRARef("sql", "digest-2", "/adapters/sql"))
    base = make_request("d", tokens)
    for request in (first, renamed, reloaded, base):
        hasher(request)
    assert first.block_hashes == renamed.block_hashes
    assert not set(first.block_hashes) & set(reloaded.block_hashes)
    assert not set(first.block_hashes) & set(base.block_hashes)


def test_xxhash_is_xxh3_128_of_the_same_bytes() -> None:
    xx = get_hash_fn("xxhash")
    block_hash = hash_block_tokens(xx, None, [1, 2, 3, 4])
    assert len(block_hash) == 16
    assert block_hash == xxhash.xxh3_128_digest(reference_block_bytes(ROOT_BLOCK_HASH, [1, 2, 3, 4]))
    assert block_hash != hash_block_tokens(SHA256, None, [1, 2, 3, 4])


def test_unknown_hash_algo_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as excinfo:
        get_hash_fn("md5")
    assert excinfo.value.key == "prefix_caching_hash_algo"
    assert excinfo.value.value == "md5"
    assert "sha256" in excinfo.value.allowed and "xxhash" in excinfo.value.allowed


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_hash_is_identical_in_another_process(algo: str) -> None:
    code = (
        "from pagedllm.core.kv_cache.hashing import get_hash_fn, hash_block_tokens;"
        f"h = hash_block_tokens(get_hash_fn({algo!r}), None, [7, 8, 9], (('salt', 'abc'), ('lora', 'x')));"
        "print(h.hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={"PYTHONHASHSEED": "12345"}
    ).stdout.strip()
    here = hash_block_tokens(get_hash_fn(algo), None, [7, 8, 9], (("salt", "abc"), ("lora", "x")))
    assert out == here.hex()
