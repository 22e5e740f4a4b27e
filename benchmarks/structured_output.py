"""Structured output: the cost of grammar masking, compiling and caching.

1. Step-time overhead of masking: EngineCore decode steps with B requests
   (B = 1, 16, 64) that all follow a JSON schema vs the same B requests
   unconstrained, same model and prompts, seeded temperature-1.0 sampling;
   the ratio is constrained / unconstrained mean step time (target <= 1.05).
   The bitmask fill (grammar_bitmask) and apply are also timed on their own.
2. Compile time per schema: each of the test suite's JSON schemas
   (tests/helpers/json_schemas.py) compiled cold by xgrammar and by the
   example llguidance backend (when installed).
3. Cache hit rate: 200 requests drawing round-robin from those schemas.

The model is a random-weight Llama (hidden 256, 4 layers, the embedded 8,192-
token BPE tokenizer) so step times are small: the overhead ratio is a worst
case for small models, where the model step is cheapest.

    .venv/bin/python benchmarks/structured_output.py [--steps 32] [--threads 1] [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

# Decode-heavy schema whose language is far longer than the measured steps.
LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 1000}


def build_model(out_dir: Path) -> Path:
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    tokenizer_dir = Path(get_tokenizer_dir())
    for item in tokenizer_dir.iterdir():
        if item.is_file():
            shutil.copy(item, out_dir / item.name)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out_dir), safe_serialization=True)
    return out_dir


def time_steps(core, batch: int, structured: bool, steps: int) -> tuple[float, float]:
    """Mean decode step time (s) and the share of it spent filling bitmasks."""
    from pagedllm.core.request import Request
    from pagedllm.core.sampling_params import SamplingParams, StructuredOutputsParams

    so = StructuredOutputsParams(json=LONG_SCHEMA, disable_any_whitespace=True) if structured else None
    for index in range(batch):
        params = SamplingParams(temperature=1.0, seed=index, max_tokens=steps + 8, ignore_eos=True,
                                structured_outputs=so)
        core.add_request(Request(f"{structured}-{batch}-{index}", [10 + index % 50, 11, 12, 13], params,
                                 eos_token_id=None))
    manager = core.structured_output_manager
    fill_time = 0.0
    original = manager.grammar_bitmask

    def timed_bitmask(*args, **kwargs):
        nonlocal fill_time
        start = time.perf_counter()
        result = original(*args, **kwargs)
        fill_time += time.perf_counter() - start
        return result

    manager.grammar_bitmask = timed_bitmask
    # Until every request has its grammar and its prefill is done.
    while len(core.scheduler.running) < batch or any(r.num_output_tokens == 0 for r in core.scheduler.running):
        if not core.step().made_progress:
            core.wait_for_work()
    fill_time = 0.0
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    manager.grammar_bitmask = original
    core.abort_requests(list(core.scheduler.requests))
    core.step()
    mean = statistics.mean(times)
    return mean, fill_time / steps


def time_apply(vocab_size: int, batch: int, reps: int = 50) -> float:
    from pagedllm.structured_output.bitmask import allocate_token_bitmask
    from pagedllm.worker.grammar_bitmask import apply_token_bitmask_inplace

    logits = torch.randn(batch, vocab_size)
    bitmask = allocate_token_bitmask(batch, vocab_size)
    bitmask[:, ::2] = 0x0F0F0F0F
    rows = list(range(batch))
    start = time.perf_counter()
    for _ in range(reps):
        apply_token_bitmask_inplace(logits, bitmask, rows)
    return (time.perf_counter() - start) / reps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from helpers.json_schemas import SCHEMAS

    from pagedllm.core.config import EngineConfig, StructuredOutputConfig
    from pagedllm.core.request import Request
    from pagedllm.core.sampling_params import SamplingParams, StructuredOutputsParams
    from pagedllm.engine.builder import build_engine_core
    from pagedllm.model_registry.tokenizer import load_tokenizer
    from pagedllm.structured_output.interface import StructuredOutputKind
    from pagedllm.structured_output.manager import StructuredOutputManager
    from pagedllm.structured_output.xgrammar_backend import XgrammarBackend

    with tempfile.TemporaryDirectory(prefix="pagedllm-so-bench-") as tmp:
        model_dir = build_model(Path(tmp))
        tokenizer = load_tokenizer(str(model_dir))
        vocab_size = len(tokenizer)
        config = EngineConfig.load(model={"model": str(model_dir), "dtype": "float32", "max_model_len": 1024},
                                   cache={"num_kv_blocks": 1024}, scheduler={"max_num_seqs": 64})
        core = build_engine_core(config)
        time_steps(core, 4, True, 4)  # warm-up (compiles the schema once)
        time_steps(core, 4, False, 4)

        print(f"## Step time, decode, seeded temperature 1.0 ({args.steps} steps, {args.threads} threads, "
              f"vocab {vocab_size})\n")
        print("| batch | unconstrained ms | json-schema ms | ratio | bitmask fill ms | bitmask apply ms |")
        print("|---:|---:|---:|---:|---:|---:|")
        for batch in (1, 16, 64):
            # Alternate the two so drifting machine load hits both alike; best of `reps`.
            plain_runs, constrained_runs = [], []
            for _ in range(args.reps):
                plain_runs.append(time_steps(core, batch, False, args.steps)[0])
                constrained_runs.append(time_steps(core, batch, True, args.steps))
            plain = min(plain_runs)
            constrained, fill = min(constrained_runs, key=lambda r: r[0])
            apply = time_apply(vocab_size, batch)
            print(f"| {batch} | {plain * 1e3:.2f} | {constrained * 1e3:.2f} | {constrained / plain:.3f} | "
                  f"{fill * 1e3:.3f} | {apply * 1e3:.3f} |")

        print("\n## Compile time per schema (cold, no cache)\n")
        print("| backend | schemas | mean ms | median ms | max ms (schema) |")
        print("|---|---:|---:|---:|---|")
        backends = [("xgrammar", XgrammarBackend)]
        try:
            from pagedllm_example_grammar.backend import GuidanceBackend

            backends.append(("guidance (llguidance)", GuidanceBackend))
        except ImportError:
            pass
        for name, backend_cls in backends:
            backend = backend_cls(tokenizer, vocab_size, tokenizer.eos_token_id, StructuredOutputConfig())
            times = {}
            for schema_name, schema in SCHEMAS.items():
                start = time.perf_counter()
                backend.compile(StructuredOutputKind.JSON, json.dumps(schema), any_whitespace=False)
                times[schema_name] = time.perf_counter() - start
            slowest = max(times, key=times.get)
            print(f"| {name} | {len(times)} | {statistics.mean(times.values()) * 1e3:.2f} | "
                  f"{statistics.median(times.values()) * 1e3:.2f} | {times[slowest] * 1e3:.2f} ({slowest}) |")

        print("\n## Cache on repeated schemas\n")
        manager = StructuredOutputManager(StructuredOutputConfig(), vocab_size=vocab_size, tokenizer=tokenizer,
                                          eos_token_id=tokenizer.eos_token_id, max_num_rows=8)
        schemas = list(SCHEMAS.values())
        requests = []
        start = time.perf_counter()
        for index in range(200):
            so = StructuredOutputsParams(json=schemas[index % len(schemas)], disable_any_whitespace=True)
            request = Request(str(index), [5], SamplingParams(structured_outputs=so), eos_token_id=None)
            manager.grammar_init(request)
            requests.append(request)
        for request in requests:
            request.structured_output_request.future.result()
            request.structured_output_request.is_ready()
        elapsed = time.perf_counter() - start
        stats = manager.stats
        print("| requests | distinct schemas | hits | misses | hit rate | all ready in ms |")
        print("|---:|---:|---:|---:|---:|---:|")
        print(f"| 200 | {len(schemas)} | {stats.hits} | {stats.misses} | {stats.hit_rate:.1%} | {elapsed * 1e3:.1f} |")
        manager.close()


if __name__ == "__main__":
    main()
