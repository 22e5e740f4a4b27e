"""Multi-LoRA throughput: the base model against 1, 4 and 16 distinct
adapters in one batch, pagedllm against vLLM's CPU build (issue 36).

The ~100M Llama in bfloat16 (checkpoints.py), rank-16 adapters on all seven
projections (q, k, v, o, gate, up, down; random A and B, PEFT's format,
written once into the cache), 32 prompts of 64-256 tokens x 64 new tokens,
greedy, ignore_eos, max_num_seqs 32 (every prompt in one batch: offline
concurrency 32). Request i uses adapter i mod N. Each (engine, N) runs in a
fresh child process: model load, one untimed warm-up generate, --runs timed
ones. The table gives tokens/s, the fraction of the same engine's base-model
throughput (the issue's target: at least 0.7 with 16 adapters), and
pagedllm/vLLM.

    .venv/bin/python benchmarks/peer/lora.py [--adapters 0,-1,1,4,16] [--engines pagedllm,vllm-2c] [--runs 2]
        [--num-prompts 32] [--num-new-tokens 64] [--cores 0-1] [--kv-cache-gib 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from offline import make_prompts
from peer_common import (
    ENGINES,
    PEERS,
    add_placement_args,
    engine_of,
    fmt,
    fmt_ratio,
    log,
    markdown_table,
    median,
    peers_arg,
    placement_from_args,
    print_result,
    run_json_child,
)

RANK = 16
ALPHA = 32
PROJECTIONS = (("self_attn", "q_proj"), ("self_attn", "k_proj"), ("self_attn", "v_proj"), ("self_attn", "o_proj"),
               ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
MAX_ADAPTERS = 16


def write_adapter(out_dir: Path, model_path: Path, seed: int) -> None:
    """A rank-16 PEFT adapter on every projection of `model_path`'s layers."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    with safe_open(model_path / "model.safetensors", framework="pt") as reader:
        for key in reader.keys():  # noqa: SIM118
            module = key.removesuffix(".weight")
            if not any(module.endswith(f"{part}.{name}") for part, name in PROJECTIONS):
                continue
            out_features, in_features = reader.get_slice(key).get_shape()
            prefix = f"base_model.model.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(RANK, in_features, generator=generator) / in_features**0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out_features, RANK, generator=generator) * 0.01
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": RANK, "lora_alpha": ALPHA, "lora_dropout": 0.0,
              "bias": "none", "target_modules": [name for _, name in PROJECTIONS],
              "base_model_name_or_path": str(model_path)}
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2))


def adapter_dirs(model_path: Path) -> list[str]:
    from pagedllm.model_registry.tiny.cache import build_once

    return [str(build_once(f"peer-lora-100m-r{RANK}-{index}-v1",
                           lambda out, index=index: write_adapter(out, model_path, seed=index)))
            for index in range(MAX_ADAPTERS)]


# ---- child: one engine, one adapter count, one process ----------------------


def build_llm(engine: str, model_path: str, num_adapters: int, kv_cache_gib: int):  # type: ignore[no-untyped-def]
    # -1: LoRA on, every request on the base model (what enabling LoRA alone costs).
    lora = dict(enable_lora=True, max_loras=MAX_ADAPTERS, max_lora_rank=RANK) if num_adapters else {}
    if engine_of(engine) == "vllm":
        from vllm import LLM, SamplingParams  # type: ignore[import-not-found]
        from vllm.lora.request import LoRARequest  # type: ignore[import-not-found]

        llm = LLM(model=model_path, dtype="bfloat16", seed=0, max_num_seqs=32, **lora)
        return llm, SamplingParams, LoRARequest
    from pagedllm import LLM, SamplingParams
    from pagedllm.lora.request import LoRARequest

    llm = LLM(model=model_path, dtype="bfloat16", seed=0, max_num_seqs=32, kv_cache_memory_bytes=kv_cache_gib << 30,
              **lora)
    return llm, SamplingParams, LoRARequest


def run_child(args: argparse.Namespace) -> dict:
    prompts = json.loads(Path(args.prompts_file).read_text())
    adapters = json.loads(args.adapter_dirs)[: max(args.num_adapters, 0)]
    llm, sampling_params_cls, lora_request_cls = build_llm(args.child, args.model_path, args.num_adapters,
                                                           args.kv_cache_gib)
    params = sampling_params_cls(temperature=0.0, max_tokens=args.num_new_tokens, ignore_eos=True)
    inputs = [{"prompt_token_ids": prompt} for prompt in prompts]
    requests = None
    if adapters:
        requests = [lora_request_cls(f"adapter-{i % len(adapters)}", i % len(adapters) + 1, adapters[i % len(adapters)])
                    for i in range(len(prompts))]
    llm.generate(inputs, params, use_tqdm=False, lora_request=requests)  # warm-up: loads every adapter
    times = []
    for _ in range(args.runs):
        llm.reset_prefix_cache()
        start = time.perf_counter()
        llm.generate(inputs, params, use_tqdm=False, lora_request=requests)
        times.append(time.perf_counter() - start)
    return {"times": times}


# ---- parent -----------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--adapters", default="0,-1,1,4,16",
                        help="distinct adapter counts; 0 = the base model, -1 = the base model with LoRA on")
    parser.add_argument("--engines", type=peers_arg, default=",".join(ENGINES),
                        help="comma-separated, from " + ",".join(PEERS) + " (default %(default)s)")
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--num-new-tokens", type=int, default=64)
    parser.add_argument("--child-timeout", type=float, default=1800.0)
    add_placement_args(parser)
    parser.add_argument("--child", choices=PEERS, help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--prompts-file", help=argparse.SUPPRESS)
    parser.add_argument("--num-adapters", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--adapter-dirs", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print_result(run_child(args))
        return
    from checkpoints import checkpoint_dir

    model_path = checkpoint_dir("100m", "bfloat16")
    dirs = json.dumps(adapter_dirs(model_path))
    counts = [int(count) for count in args.adapters.split(",")]
    engines = args.engines
    vllm_peers = [engine for engine in engines if engine != "pagedllm"] if "pagedllm" in engines else []
    placement = placement_from_args(args)
    tok_s: dict[tuple[str, int], float] = {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="peer-prompts-") as prompts_file:
        json.dump(make_prompts(args.num_prompts, 64, 256), prompts_file)
        prompts_file.flush()
        for count in counts:
            for engine in engines:
                cmd = [placement.python(engine), __file__, "--child", engine, "--model-path", str(model_path),
                       "--prompts-file", prompts_file.name, "--runs", str(args.runs), "--num-adapters", str(count),
                       "--adapter-dirs", dirs, "--num-new-tokens", str(args.num_new_tokens),
                       "--kv-cache-gib", str(args.kv_cache_gib)]
                answer = run_json_child(cmd, placement.env(engine), placement, args.child_timeout, f"{engine} child")
                tok_s[(engine, count)] = args.num_prompts * args.num_new_tokens / median(answer["times"])
                log(f"{engine} {count} adapters: " + ", ".join(f"{t:.2f}" for t in answer["times"]) + " s")
    rows = []
    for count in counts:
        row = [{0: "base model", -1: "base model, LoRA on"}.get(count, str(count))]
        for engine in engines:
            base = tok_s.get((engine, 0))
            row += [fmt(tok_s[(engine, count)]), fmt(tok_s[(engine, count)] / base, 2) if base else "-"]
        row += [fmt_ratio(tok_s[("pagedllm", count)] / tok_s[(peer, count)]) for peer in vllm_peers]
        rows.append(row)
    headers = ["distinct adapters"]
    for engine in engines:
        headers += [f"{engine} out tok/s", f"{engine} / its base"]
    headers += [f"pagedllm/{peer}" for peer in vllm_peers]
    print(f"\n~100M Llama bfloat16, rank-{RANK} adapters on all projections, {args.num_prompts} prompts x "
          f"{args.num_new_tokens} tokens, max_num_seqs 32, cores {args.cores}; median of {args.runs} runs.\n")
    print(markdown_table(headers, rows))


if __name__ == "__main__":
    sys.exit(main())
