"""The random dataset: token-id prompts of a fixed length with an optional
shared prefix, or one of several (prompt families, for cache-aware routing).

Token-id prompts (accepted by both vLLM and pagedllm) make the prompt length
exact on the server whatever its tokenizer does to text.
"""

from __future__ import annotations

import random
from typing import NamedTuple

from pagedllm.core.errors import ConfigError

# Without a tokenizer: ids that are ordinary tokens in the usual vocabularies
# (specials sit at 0-4 in the embedded tokenizer, at the top in GPT-2/Qwen/Llama-3)
# and that exist in small test models (vocab 512).
SAFE_TOKEN_ID_RANGE = (10, 500)


class BenchRequest(NamedTuple):
    prompt_token_ids: list[int]
    output_len: int


def token_id_pool(tokenizer_path: str | None) -> list[int]:
    """Ids prompts are drawn from: the tokenizer's vocabulary less its special tokens."""
    if tokenizer_path is None:
        return list(range(*SAFE_TOKEN_ID_RANGE))
    from pagedllm.model_registry.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    special = set(tokenizer.all_special_ids)
    return [token_id for token_id in range(len(tokenizer)) if token_id not in special]


def sample_random_requests(
    num_prompts: int,
    input_len: int,
    output_len: int,
    prefix_len: int = 0,
    seed: int = 0,
    token_ids: list[int] | None = None,
    num_prefixes: int = 1,
) -> list[BenchRequest]:
    """`num_prompts` prompts of `prefix_len + input_len` ids; the first
    `prefix_len` are the same in every prompt (as vLLM's random dataset), or,
    with `num_prefixes` > 1, one of that many prefixes drawn at random per
    prompt (families of prompts sharing a prefix, arriving in random order)."""
    for name, value, low in (("--num-prompts", num_prompts, 1), ("--input-len", input_len, 1),
                             ("--output-len", output_len, 1), ("--prefix-len", prefix_len, 0),
                             ("--num-prefixes", num_prefixes, 1)):
        if value < low:
            raise ConfigError(name, value, f"an integer >= {low}")
    pool = token_ids if token_ids is not None else list(range(*SAFE_TOKEN_ID_RANGE))
    if not pool:
        raise ConfigError("--tokenizer", "(empty vocabulary)", "a tokenizer with non-special tokens")
    rng = random.Random(seed)
    prefixes = [[rng.choice(pool) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    requests = []
    for _ in range(num_prompts):
        # NOTE: one prefix draws nothing, so a seed gives the prompts it always gave.
        prefix = prefixes[rng.randrange(num_prefixes)] if num_prefixes > 1 else prefixes[0]
        requests.append(BenchRequest(prefix + [rng.choice(pool) for _ in range(input_len)], output_len))
    return requests
