"""KV transfer benchmark: consumer TTFT against a full prefill, and the CPU
offload tier's hit rate on a workload that cycles more prefixes than fit.

    python benchmarks/kv_transfer.py [--prompt-tokens 1000] [--reps 5]

1. TTFT: a 1,000-token prompt (random token ids) on the shipped tiny model.
   A producer engine stores its blocks (shared_storage, a temporary
   directory); then, each rep, a fresh consumer engine (prefix caching off,
   so every rep loads) generates one token, against an engine without a
   connector prefilling the whole prompt. Median of the reps.
2. Offload: 12 prefixes of 256 tokens, each followed by a short suffix,
   visited round-robin three times through a pool of 40 blocks (about two
   prefixes): without a connector every visit recomputes; with cpu_offload
   (1 GiB) the evicted blocks come back from CPU memory. Reported: the share
   of prefix tokens served by the primary cache and by the CPU tier, and the
   wall time.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "2")


def _llm(**kwargs: Any) -> Any:
    from pagedllm import LLM

    return LLM(model="tiny", dtype="float32", **kwargs)


def _run(llm: Any, prompts: list[list[int]], max_tokens: int = 1) -> float:
    from pagedllm import SamplingParams

    started = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - started


def ttft(prompt_tokens: int, reps: int) -> list[tuple[str, float]]:
    rng = random.Random(0)
    prompt = [rng.randrange(10, 8000) for _ in range(prompt_tokens)]
    with tempfile.TemporaryDirectory() as path:
        storage = {"connector": "shared_storage", "extra": {"path": path}}
        _run(_llm(num_kv_blocks=128, kv_transfer_config={**storage, "role": "producer"}), [prompt])
        plain = _llm(num_kv_blocks=128, enable_prefix_caching=False)
        _run(plain, [prompt])  # warm-up
        full = [_run(plain, [prompt]) for _ in range(reps)]
        loaded = []
        for _ in range(reps):
            consumer = _llm(num_kv_blocks=128, enable_prefix_caching=False,
                            kv_transfer_config={**storage, "role": "consumer"})
            _run(consumer, [prompt[:32]])  # warm-up on an unrelated short prompt
            loaded.append(_run(consumer, [prompt]))
    return [("full prefill", statistics.median(full)), ("consumer (blocks loaded)", statistics.median(loaded))]


def offload() -> list[dict[str, Any]]:
    rng = random.Random(1)
    prefixes = [[rng.randrange(10, 8000) for _ in range(256)] for _ in range(12)]
    workload = [prefix + [rng.randrange(10, 8000) for _ in range(8)] for _ in range(3) for prefix in prefixes]
    rows = []
    for label, kv in (("no connector", None), ("cpu_offload 1 GiB", {"connector": "cpu_offload",
                                                                    "extra": {"cpu_bytes": 1 << 30}})):
        llm = _llm(num_kv_blocks=40, **({"kv_transfer_config": kv} if kv else {}))
        core = llm.engine_core.engine_core
        started = time.perf_counter()
        for prompt in workload:
            _run(llm, [prompt], max_tokens=4)
        seconds = time.perf_counter() - started
        manager = core.kv_cache_manager
        stats = core.scheduler.kv_connector_stats
        queries = sum(len(p) for p in workload)
        rows.append({
            "setup": label,
            "seconds": seconds,
            "primary_hit_rate": manager.total_prefix_cache_hits / queries,
            "tier_hit_rate": (stats.external_hits / queries) if stats else 0.0,
            "prompt_tokens_computed": core.scheduler.num_prompt_tokens_computed,
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    rows = ttft(args.prompt_tokens, args.reps)
    base = rows[0][1]
    print(f"TTFT, {args.prompt_tokens}-token prompt, pagedllm-tiny float32, median of {args.reps}")
    print(f"{'setup':<28}{'seconds':>10}{'vs full':>10}")
    for label, seconds in rows:
        print(f"{label:<28}{seconds:>10.4f}{base / seconds:>9.2f}x")
    print()
    print("Offload tier: 12 prefixes x 256 tokens, round-robin x3, 40-block pool (~2 prefixes)")
    print(f"{'setup':<22}{'seconds':>9}{'primary hits':>14}{'tier hits':>11}{'computed':>10}")
    for row in offload():
        print(f"{row['setup']:<22}{row['seconds']:>9.2f}{row['primary_hit_rate']:>13.1%}"
              f"{row['tier_hit_rate']:>11.1%}{row['prompt_tokens_computed']:>10}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
