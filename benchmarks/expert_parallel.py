"""Expert parallelism against tensor parallelism for the MoE layers, 2 ranks, same run.

The model: a Qwen3-MoE shape small enough for a CPU host, built from
transformers' `Qwen3MoeConfig` with dummy (random, seeded) weights: hidden
512, 4 layers, 8/4 heads of 64, 32 experts of moe_intermediate 256, top-8,
float32 (a config.json and the shipped tokenizer in a temporary folder; no
weights are written).

Rows, each an engine in its own subprocess on the mp executor at
`-tp 2` (eager: CPU steps with collectives are never captured anyway):

- `tp2`: every expert sliced over both ranks, one all-reduce per MoE layer;
- `ep2`: `--enable-expert-parallel`, 16 whole experts per rank, each rank's
  token share exchanged all-to-all (3 all-to-alls and an all-gather per
  MoE layer: model_registry/layers/expert_parallel.py).

Workloads, each run --reps times after a warm-up; each step of the
engine core is timed around the executor's call (rank 0's collective
counters read before and after it), and the table shows the median of
the steps of exactly the workload's size:

- decode at batch 1 and 32: 16-token prompts, --decode-steps decode steps;
- prefill: 4 prompts of 256 tokens in one 1024-token step.

"tp comm" is rank 0's tensor-parallel collectives per step (attention's
all-reduces, the logits' gather, and under tp2 the MoE all-reduce), "ep comm"
its expert-parallel group's (the MoE layers' all-to-alls and all-gathers,
timed inside the layer by the group's counters), both wall time including
the wait for the slower rank, and "share" ep comm over the step.
On a shared two-core host the numbers are noisy and say little about
GPUs: see docs/distributed.md.

    .venv/bin/python benchmarks/expert_parallel.py [--reps 3] [--decode-steps 16]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROWS = {"tp2": False, "ep2": True}  # name -> enable_expert_parallel
WORKLOADS = ("decode_bs1", "decode_bs32", "prefill_1024")


def build_model_dir(folder: Path) -> Path:
    """A Qwen3-MoE config.json and the shipped tokenizer (dummy weights: no weight files)."""
    from transformers import AutoTokenizer, Qwen3MoeConfig

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    tokenizer_dir = Path(get_tokenizer_dir())
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, head_dim=64, intermediate_size=1024, moe_intermediate_size=256,
        num_experts=32, num_experts_per_tok=8, norm_topk_prob=True, max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(str(folder))
    for item in tokenizer_dir.iterdir():
        if item.is_file():
            shutil.copy(item, folder / item.name)
    return folder


class StepTimer:
    """Wraps the engine core's executor: each step's wall time and rank 0's
    collective counters around it, by the step's number of tokens."""

    def __init__(self, llm: Any) -> None:
        self.executor = llm.engine_core.engine_core.model_executor
        self.execute_model = self.executor.execute_model
        self.executor.execute_model = self
        self.steps: list[tuple[int, float, float, float]] = []  # (tokens, seconds, tp seconds, ep seconds)

    def __call__(self, scheduler_output: Any) -> Any:
        before = self.executor.collective_rpc("collective_stats")[0]
        start = time.perf_counter()
        output = self.execute_model(scheduler_output)
        seconds = time.perf_counter() - start
        after = self.executor.collective_rpc("collective_stats")[0]
        self.steps.append((scheduler_output.total_num_scheduled_tokens, seconds,
                           after["collective_seconds"] - before["collective_seconds"],
                           after["ep_collective_seconds"] - before["ep_collective_seconds"]))
        return output

    def take(self, num_tokens: int) -> list[dict[str, float]]:
        """The steps of exactly `num_tokens` tokens since the last call, in ms."""
        steps, self.steps = self.steps, []
        return [{"step_ms": 1000 * s, "tp_ms": 1000 * tp, "ep_ms": 1000 * ep}
                for tokens, s, tp, ep in steps if tokens == num_tokens]


def run_row(row: str, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    """In the child process: one engine, each workload --reps times."""
    import random

    from pagedllm import LLM, SamplingParams

    llm = LLM(model=args.model_path, load_format="dummy", dtype="float32", tensor_parallel_size=2,
              enable_expert_parallel=ROWS[row], enforce_eager=True, max_num_seqs=64,
              max_num_batched_tokens=1024, max_model_len=512)
    rng = random.Random(0)
    vocab = json.loads((Path(args.model_path) / "config.json").read_text())["vocab_size"]
    # workload -> (prompts, new tokens, tokens of the steps it measures)
    workloads = {
        "decode_bs1": ([[rng.randrange(8, vocab) for _ in range(16)]], 1 + args.decode_steps, 1),
        "decode_bs32": ([[rng.randrange(8, vocab) for _ in range(16)] for _ in range(32)],
                        1 + args.decode_steps, 32),
        "prefill_1024": ([[rng.randrange(8, vocab) for _ in range(256)] for _ in range(4)], 1, 1024),
    }
    results: dict[str, list[dict[str, float]]] = {name: [] for name in WORKLOADS}
    timer = StepTimer(llm)
    try:
        for rep in range(args.reps + 1):  # the first: warm-up
            for name, (prompts, max_tokens, step_tokens) in workloads.items():
                llm.reset_prefix_cache()
                params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
                llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                steps = timer.take(step_tokens)
                if rep:
                    results[name] += steps
    finally:
        llm.shutdown()
    return results


def print_table(results: dict[str, dict[str, list[dict[str, float]]]], args: argparse.Namespace) -> None:
    print(f"\nQwen3-MoE-shaped (hidden 512, 4 layers, 32 experts x 256, top-8), float32 dummy weights, "
          f"-tp 2 mp, median step over {args.reps} runs; shared CPU host: noisy")
    print(f"{'workload':<14}{'row':<6}{'step ms':>9}{'vs tp2':>8}{'tp comm ms':>12}{'ep comm ms':>12}{'share':>8}")
    for name in WORKLOADS:
        base = statistics.median(r["step_ms"] for r in results["tp2"][name])
        for row in ROWS:
            cells = results[row][name]
            step = statistics.median(r["step_ms"] for r in cells)
            tp_ms = statistics.median(r["tp_ms"] for r in cells)
            ep_ms = statistics.median(r["ep_ms"] for r in cells)
            print(f"{name:<14}{row:<6}{step:>9.2f}{base / step:>8.2f}{tp_ms:>12.2f}{ep_ms:>12.2f}"
                  f"{ep_ms / step if step > 0 else 0.0:>8.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--row", choices=list(ROWS), help=argparse.SUPPRESS)  # child mode
    parser.add_argument("--model-path", help=argparse.SUPPRESS)  # child mode
    args = parser.parse_args()
    if args.row:
        print(json.dumps(run_row(args.row, args)))
        return
    results = {}
    with tempfile.TemporaryDirectory(prefix="pagedllm-ep-bench-") as folder:
        model_path = str(build_model_dir(Path(folder)))
        env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        for row in ROWS:
            child = subprocess.run(
                [sys.executable, __file__, "--row", row, "--model-path", model_path, *sys.argv[1:]],
                check=True, capture_output=True, text=True, env=env,
            )
            results[row] = json.loads(child.stdout.strip().splitlines()[-1])
    print_table(results, args)


if __name__ == "__main__":
    main()
