"""Model-free drafters: microseconds per request for one `propose` call.

Batches of 1, 8 and 32 requests of about 1k tokens (prompt + output; a few
repeated spans so that matches exist) are drafted by:

- `ngram (loop)`: the per-request rule (`ngram_propose`) in a Python loop,
  what `NgramDrafter.propose` did before it was vectorised;
- `ngram (batch)`: `NgramDrafter.propose`, one vectorised pass over the batch;
- `suffix`: `SuffixDrafter.propose`.

Each is timed in steady state, as in decoding: every call sees one more token
per request than the last (the drafters that keep state append just that).

All rows come from the same run; `ratio` is loop / batch. Times are medians
of `--repeats` calls and depend on the machine's load.

    .venv/bin/python benchmarks/ngram_proposer.py [--num-tokens 1024] [--repeats 50]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np

from pagedllm.core.config import SpeculativeConfig
from pagedllm.spec_decode.interface import DraftInputs
from pagedllm.spec_decode.ngram import NgramDrafter, ngram_propose
from pagedllm.spec_decode.suffix import SuffixDrafter

BATCH_SIZES = (1, 8, 32)
K = 4


def _sequences(batch_size: int, num_tokens: int, rng: np.random.Generator) -> list[list[int]]:
    sequences = []
    for _ in range(batch_size):
        tokens = rng.integers(0, 32000, size=num_tokens).tolist()
        for _ in range(8):  # copy a few spans: code and chat repeat themselves
            src, dst = (int(x) for x in rng.integers(0, num_tokens - 32, size=2))
            tokens[dst : dst + 16] = tokens[src : src + 16]
        sequences.append(tokens)
    return sequences


def _median_us(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def _steady_state_us(propose: Callable[[list[list[int]]], object], sequences: list[list[int]], repeats: int) -> float:
    """Median time of `propose` over the batch when, as in decoding, each call
    sees one more token per request than the last (the first call, which
    sees everything but the last `repeats` tokens, is not timed)."""
    start = len(sequences[0]) - repeats
    grown = [list(tokens[:start]) for tokens in sequences]
    propose(grown)
    step = iter(range(start, len(sequences[0])))

    def one_step() -> None:
        position = next(step)
        for tokens, full in zip(grown, sequences, strict=True):
            tokens.append(full[position])
        propose(grown)

    return _median_us(one_step, repeats)


def _bench(batch_size: int, num_tokens: int, repeats: int) -> tuple[float, float, float]:
    rng = np.random.default_rng(batch_size)
    sequences = _sequences(batch_size, num_tokens, rng)
    req_ids = [str(i) for i in range(batch_size)]
    context = SimpleNamespace(max_model_len=num_tokens + 4096)
    config = SpeculativeConfig(method="ngram", num_speculative_tokens=K)
    ngram = NgramDrafter(config, context)  # type: ignore[arg-type]
    suffix = SuffixDrafter(SpeculativeConfig(method="suffix", num_speculative_tokens=K), context)  # type: ignore[arg-type]
    min_n, max_n = config.prompt_lookup_min, config.prompt_lookup_max
    timings = [
        _steady_state_us(lambda batch: [ngram_propose(t, min_n, max_n, K) for t in batch], sequences, repeats),
        _steady_state_us(lambda batch: ngram.propose(DraftInputs(req_ids, batch, [])), sequences, repeats),
        _steady_state_us(lambda batch: suffix.propose(DraftInputs(req_ids, batch, [])), sequences, repeats),
    ]
    loop, batch, suffix_us = (t / batch_size for t in timings)
    return loop, batch, suffix_us


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--num-tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    print(f"us per request, {args.num_tokens} tokens each, k={K}, median of {args.repeats} calls")
    print(f"{'batch':>5}  {'ngram (loop)':>12}  {'ngram (batch)':>13}  {'ratio':>6}  {'suffix':>8}")
    for batch_size in BATCH_SIZES:
        loop, batch, suffix = _bench(batch_size, args.num_tokens, args.repeats)
        print(f"{batch_size:>5}  {loop:>12.1f}  {batch:>13.1f}  {loop / batch:>5.2f}x  {suffix:>8.1f}")


if __name__ == "__main__":
    main()
