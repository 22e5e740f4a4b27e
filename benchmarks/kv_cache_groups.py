"""KV cache groups (the hybrid allocator): capacity and decode step time.

1. Capacity, no model: a Gemma-3-shaped layer list (five sliding-window
   layers per global one, window 1,024) and a fixed KV budget in layer pages
   (one block of one layer). The scheduler runs 8k-token requests (prompts
   prefilled in 2,048-token chunks, then decode) with a null model, with
   groups and without (`cache.disable_hybrid_kv_cache_manager`), and the
   table shows the most sequences decoding at once and the preemptions.
2. Decode step time at equal batch: a Qwen2 checkpoint with random weights
   whose `layer_types` follow the same 5:1 pattern runs B requests of
   context C through LLM (float32, CPU), with groups and without; the
   step time is the median of the runner's steps in which every request
   decodes one token.

    .venv/bin/python benchmarks/kv_cache_groups.py [--budget-pages 147456] [--context 1024]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.core.config import SchedulerConfig
from pagedllm.core.kv_cache.hybrid_manager import make_kv_cache_manager
from pagedllm.core.kv_cache.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    SlidingWindowSpec,
    get_kv_cache_config,
)
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.core.scheduler import Scheduler
from pagedllm.core.scheduler_output import ModelRunnerOutput

BLOCK_SIZE = 16


def gemma3_layer_specs(num_layers: int, window: int) -> list[FullAttentionSpec | SlidingWindowSpec]:
    sliding = SlidingWindowSpec(BLOCK_SIZE, sliding_window=window)
    return [FullAttentionSpec(BLOCK_SIZE) if layer % 6 == 5 else sliding for layer in range(num_layers)]


def run_capacity(config: KVCacheConfig, budget_pages: int, num_requests: int, context: int) -> tuple[int, int, int]:
    """(blocks, most sequences decoding at once, preemptions) under a null model."""
    num_blocks = budget_pages // config.num_kv_tensors
    manager = make_kv_cache_manager(config, num_blocks, BLOCK_SIZE, enable_caching=False)
    scheduler_config = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256)
    scheduler = Scheduler(scheduler_config, manager, max_model_len=context + 64)
    # Long enough a decode that every admitted request is still decoding
    # when the last one has prefilled (4 chunks each): memory, not arrival
    # order, decides how many decode at once.
    max_tokens = 4 * num_requests + 32
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for index in range(num_requests):
        scheduler.add_request(Request(str(index), [8 + index] * (context - max_tokens), params, eos_token_id=1))
    most_decoding = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        decoding = [r for r in scheduler.running if r.num_computed_tokens > r.num_prompt_tokens]
        most_decoding = max(most_decoding, len(decoding))
        sampled = {
            request_id: [9]
            for request_id, num_new in output.num_scheduled_tokens.items()
            if scheduler.requests[request_id].num_computed_tokens >= scheduler.requests[request_id].num_tokens
        }
        scheduler.update_from_output(output, ModelRunnerOutput(sampled_token_ids=sampled))
    return num_blocks, most_decoding, scheduler.num_preemptions


def capacity_table(args: argparse.Namespace) -> None:
    specs = gemma3_layer_specs(args.num_layers, args.window)
    print(f"capacity: {args.num_layers} layers (5 sliding : 1 full, window {args.window}), "
          f"{args.capacity_context}-token sequences, budget {args.budget_pages} layer pages of {BLOCK_SIZE} tokens")
    print(f"{'KV cache':<22}{'groups':>7}{'tensors':>8}{'blocks':>8}{'decoding at once':>18}{'preemptions':>13}")
    results = {}
    for name, enable_hybrid in (("full-length (off)", False), ("groups (hybrid)", True)):
        config = get_kv_cache_config(specs, enable_hybrid)
        num_blocks, most, preemptions = run_capacity(
            config, args.budget_pages, args.num_requests, args.capacity_context
        )
        results[enable_hybrid] = most
        print(f"{name:<22}{config.num_groups:>7}{config.num_kv_tensors:>8}{num_blocks:>8}{most:>18}{preemptions:>13}")
    print(f"ratio: {results[True] / max(1, results[False]):.2f}x the sequences (target >= 3x)\n")


def build_checkpoint(path: Path, args: argparse.Namespace) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    layer_types = ["full_attention" if layer % 6 == 5 else "sliding_attention" for layer in range(args.model_layers)]
    config = Qwen2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=args.model_layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.context + 128,
        use_sliding_window=True, sliding_window=args.model_window, max_window_layers=0, layer_types=layer_types,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    return path


def timed_engine(path: Path, args: argparse.Namespace, disable_hybrid: bool) -> tuple[Any, list[float]]:
    """An LLM whose model runner records the wall time of every step in
    which each request decodes one token (the list it fills)."""
    from pagedllm import LLM

    # Room for the whole batch's prefill in one step: with groups each group
    # holds a prompt's blocks until its window frees them (at most one group a layer).
    num_blocks = args.batch * (args.context // BLOCK_SIZE + 4) * (1 if disable_hybrid else args.model_layers)
    llm = LLM(
        model=str(path), dtype="float32", num_kv_blocks=num_blocks,
        max_num_seqs=args.batch, max_num_batched_tokens=args.batch * args.context,
        enable_prefix_caching=False, disable_hybrid_kv_cache_manager=disable_hybrid,
    )
    runner = llm.engine_core.engine_core.model_executor.driver_worker.model_runner
    execute_model = runner.execute_model
    decode_steps: list[float] = []

    def timed(scheduler_output: Any) -> Any:
        start = time.perf_counter()
        output = execute_model(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == args.batch:  # every request one token
            decode_steps.append(time.perf_counter() - start)
        return output

    runner.execute_model = timed
    return llm, decode_steps


def decode_table(args: argparse.Namespace) -> None:
    from pagedllm import SamplingParams as Params

    with tempfile.TemporaryDirectory(prefix="pagedllm-kv-groups-") as tmp:
        path = build_checkpoint(Path(tmp), args)
        print(f"decode step: Qwen2 {args.model_layers} layers (5:1, window {args.model_window}), hidden 256, "
              f"batch {args.batch}, context {args.context}, float32 CPU, median of the decode steps")
        engines = {name: timed_engine(path, args, disable_hybrid=name == "off") for name in ("off", "groups")}
        prompts = [{"prompt_token_ids": [(7 * r + i) % 500 + 8 for i in range(args.context)]}
                   for r in range(args.batch)]
        params = Params(temperature=0.0, max_tokens=1 + args.decode_steps, ignore_eos=True)
        for llm, steps in engines.values():
            llm.generate(prompts, params, use_tqdm=False)  # warm-up (graph captures, first-touch pages)
            steps.clear()
        for _ in range(args.reps):  # alternating, so that load on the machine hits both alike
            for llm, _steps in engines.values():
                llm.generate(prompts, params, use_tqdm=False)
        if not all(steps for _llm, steps in engines.values()):
            raise RuntimeError("a run had no step in which every request decoded")
        off, on = (statistics.median(engines[name][1]) * 1000 for name in ("off", "groups"))
        print(f"{'full-length (off)':<22}{off:>10.2f} ms/step")
        print(f"{'groups (hybrid)':<22}{on:>10.2f} ms/step")
        print(f"ratio: groups / off = {on / off:.2f} (target <= 1.0)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--num-layers", type=int, default=36)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--capacity-context", type=int, default=8192)
    # 4 full-length 8k sequences of 36 layers: 4 x 512 x 36 pages.
    parser.add_argument("--budget-pages", type=int, default=4 * 512 * 36)
    parser.add_argument("--num-requests", type=int, default=24)
    parser.add_argument("--model-layers", type=int, default=12)
    parser.add_argument("--model-window", type=int, default=128)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--skip-decode", action="store_true", help="the capacity table only")
    args = parser.parse_args()
    capacity_table(args)
    if not args.skip_decode:
        decode_table(args)


if __name__ == "__main__":
    main()
