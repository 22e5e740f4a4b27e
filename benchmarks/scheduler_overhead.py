"""Null-model benchmark: scheduler + KV cache manager time per step.

256 requests decode together with no model at all: each step is
`schedule()` then `update_from_output()` with a made-up token per request, so
what is timed is exactly the engine's bookkeeping (token budget, block
allocation, hashing of newly full blocks, stop checks). Target: <= 1 ms per
step. The table also shows the prefill step and the ratio to the target.

    .venv/bin/python benchmarks/scheduler_overhead.py [--num-requests 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from pagedllm.core.config import SchedulerConfig
from pagedllm.core.kv_cache.manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput

TARGET_MS = 1.0


def run(num_requests: int, prompt_len: int, num_steps: int, hash_algo: str) -> tuple[float, list[float]]:
    block_size = 16
    blocks_per_request = (prompt_len + num_steps + block_size) // block_size + 1
    kv = KVCacheManager(num_requests * blocks_per_request, block_size, hash_algo=hash_algo)
    config = SchedulerConfig(max_num_batched_tokens=num_requests * prompt_len, max_num_seqs=num_requests)
    scheduler = Scheduler(config, kv, max_model_len=prompt_len + num_steps + 16)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=num_steps + 8, ignore_eos=True)
    for i in range(num_requests):
        prompt = [rng.randrange(8, 8192) for _ in range(prompt_len)]
        scheduler.add_request(Request(str(i), prompt, params, eos_token_id=1))

    # The fake model's output is made outside the timed region.
    token_ids = {str(i): [rng.randrange(8, 8192)] for i in range(num_requests)}

    def one_step() -> float:
        start = time.perf_counter()
        scheduler_output = scheduler.schedule()
        elapsed = time.perf_counter() - start
        runner_output = ModelRunnerOutput(
            sampled_token_ids={req_id: token_ids[req_id] for req_id in scheduler_output.num_scheduled_tokens}
        )
        start = time.perf_counter()
        scheduler.update_from_output(scheduler_output, runner_output)
        return elapsed + time.perf_counter() - start

    prefill = one_step()
    decode = [one_step() for _ in range(num_steps)]
    assert len(scheduler.running) == num_requests, "every request should still be decoding"
    return prefill, decode


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--num-steps", type=int, default=200)
    args = parser.parse_args()

    print(f"\n{args.num_requests} running requests, prompt {args.prompt_len} tokens, "
          f"{args.num_steps} decode steps, block size 16, null model")
    print(f"{'hash':<8}{'prefill step ms':>17}{'decode step ms (median)':>25}{'p90 ms':>9}{'vs 1 ms target':>16}")
    for hash_algo in ("sha256", "xxhash"):
        prefill, decode = run(args.num_requests, args.prompt_len, args.num_steps, hash_algo)
        median_ms = statistics.median(decode) * 1e3
        p90_ms = sorted(decode)[int(0.9 * len(decode))] * 1e3
        print(f"{hash_algo:<8}{prefill * 1e3:>17.2f}{median_ms:>25.3f}{p90_ms:>9.3f}{median_ms / TARGET_MS:>16.2f}")


if __name__ == "__main__":
    main()
