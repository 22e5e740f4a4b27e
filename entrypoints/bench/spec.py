"""pagedllm bench spec: speculative decoding against no speculation, offline.

For a target model and one or more drafter configs, over a built-in prompt set
(`code`: continue held-out Python standard library files; `repeat`: a
document followed by its own beginning, so the continuation repeats it;
`chat`: free chat through the chat template), it reports per batch size
(1, 8, 32 by default): acceptance rate, mean acceptance length (1 + accepted
/ drafts), per-position acceptance, output tok/s, the speedup over no
speculation measured in the same run, the mean step time split into draft
(the drafter's propose), verify (the target's forward and sampling or
verification, as the model runner times them) and rest (everything else:
scheduling, output processing), and the fraction of the requests' steps the
speculation policy (`--policy`, default the engine's: adaptive) let draft.
Greedy decoding with ignore_eos, so every run produces the same number of
tokens. Each batch size is timed after a warm-up run of its first batch
(graphs are captured on first use). `--async-scheduling` runs every engine, no speculation included,
with async scheduling (drafts as placeholders the runner fills); `rest` is
then what the overlap leaves of the step.

    pagedllm bench spec --model tiny --methods ngram,draft_model,eagle --dataset repeat
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

DATASETS = ("code", "repeat", "chat")
CHAT_QUESTIONS = [
    "Write a Python function that reverses a string.",
    "How do I read a file line by line in Python?",
    "What does the `yield` keyword do?",
    "Explain list comprehensions with an example.",
    "How can I sort a dictionary by value?",
    "Write a class that represents a bank account.",
    "What is the difference between a list and a tuple?",
    "Show me how to use argparse.",
]
# Shipped drafter models per method (the tiny family), by their model-source
# names (the engine resolves them).
DEFAULT_DRAFTER_MODELS = {"draft_model": "tiny-draft", "eagle": "tiny-eagle"}


@dataclass
class SpecRunResult:
    method: str
    dataset: str
    batch_size: int
    num_prompts: int
    output_tokens: int
    elapsed_s: float
    output_tok_s: float
    baseline_tok_s: float | None = None
    speedup: float | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    per_position_acceptance: list[float] = field(default_factory=list)
    # Mean per step, in ms: the drafter's propose, the target's forward +
    # verification, and the rest of the step (None without a drafter).
    num_steps: int | None = None
    draft_ms: float | None = None
    verify_ms: float | None = None
    rest_ms: float | None = None
    # Of the requests' steps, the fraction the policy let draft.
    drafted_fraction: float | None = None
    async_scheduling: bool = False


def build_prompts(
    dataset: str, num_prompts: int, tokenizer: Any, *, seed: int = 0, prompt_len: int = 192
) -> list[list[int]]:
    """Token-id prompts of the built-in sets."""
    rng = random.Random(seed)
    if dataset == "chat":
        texts = [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)]}],
                add_generation_prompt=True, tokenize=False,
            )
            for i in range(num_prompts)
        ]
        return [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    from pagedllm.model_registry.tiny.corpus import load_split

    files = [f for f in load_split("validation", for_metric=True) if len(f.text) > 2000]
    rng.shuffle(files)
    prompts = []
    for source in files:
        ids = tokenizer.encode(source.text, add_special_tokens=False)
        if len(ids) < prompt_len * 2:
            continue
        start = rng.randrange(0, len(ids) - prompt_len)
        if dataset == "code":
            prompts.append(ids[start : start + prompt_len])
        else:  # repeat: the document, a separator line, then its first tokens again
            document = ids[start : start + prompt_len - 24]
            separator = tokenizer.encode("\n\n# The same code again:\n", add_special_tokens=False)
            prompts.append(document + separator + document[:16])
        if len(prompts) == num_prompts:
            return prompts
    if not prompts:
        raise RuntimeError(f"no held-out file is long enough for the {dataset!r} set")
    return [prompts[i % len(prompts)] for i in range(num_prompts)]


def _speculative_config(method: str, args: argparse.Namespace) -> dict[str, Any]:
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": args.num_speculative_tokens}
    if method == "ngram":
        config.update(prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max)
    elif method == "draft_model":
        config["model"] = args.draft_model or DEFAULT_DRAFTER_MODELS["draft_model"]
    elif method == "eagle":
        config["model"] = args.eagle_model or DEFAULT_DRAFTER_MODELS["eagle"]
    elif args.speculative_model:
        config["model"] = args.speculative_model
    return config


def _run(llm: Any, prompts: list[list[int]], batch_size: int, output_len: int) -> tuple[int, float, Any]:
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    scheduler = llm.engine_core.engine_core.scheduler
    before = _copy_stats(scheduler.total_spec_decoding_stats)
    num_tokens = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts[i : i + batch_size]], params, use_tqdm=False)
        num_tokens += sum(len(o.outputs[0].token_ids) for o in outputs)
    elapsed = time.perf_counter() - start
    return num_tokens, elapsed, _diff_stats(scheduler.total_spec_decoding_stats, before)


def _copy_stats(stats: Any) -> Any:
    if stats is None:
        return None
    from pagedllm.core.stats import SpecDecodingStats

    copy = SpecDecodingStats.new(stats.num_spec_tokens)
    copy.add(stats)
    return copy


def _diff_stats(after: Any, before: Any) -> Any:
    if after is None:
        return None
    from pagedllm.core.stats import SpecDecodingStats

    diff = SpecDecodingStats.new(after.num_spec_tokens)
    diff.num_drafts = after.num_drafts - before.num_drafts
    diff.num_draft_tokens = after.num_draft_tokens - before.num_draft_tokens
    diff.num_accepted_tokens = after.num_accepted_tokens - before.num_accepted_tokens
    diff.num_accepted_tokens_per_pos = [
        a - b for a, b in zip(after.num_accepted_tokens_per_pos, before.num_accepted_tokens_per_pos, strict=True)
    ]
    for name in ("num_steps", "verify_time_s", "draft_time_s", "num_sampled_reqs", "num_drafted_reqs"):
        setattr(diff, name, getattr(after, name) - getattr(before, name))
    return diff


def _add_step_split(result: SpecRunResult, stats: Any) -> None:
    """Mean draft / verify / rest ms per step and the policy's drafted fraction."""
    result.acceptance_rate = stats.acceptance_rate
    result.mean_acceptance_length = stats.mean_acceptance_length
    result.per_position_acceptance = stats.per_position_acceptance_rate
    result.drafted_fraction = stats.drafted_fraction
    result.num_steps = stats.num_steps
    if stats.num_steps:
        result.draft_ms = 1000 * stats.draft_time_s / stats.num_steps
        result.verify_ms = 1000 * stats.verify_time_s / stats.num_steps
        result.rest_ms = 1000 * result.elapsed_s / stats.num_steps - result.draft_ms - result.verify_ms


def run_bench(args: argparse.Namespace) -> list[SpecRunResult]:
    from tqdm import tqdm

    from pagedllm import LLM
    from pagedllm.model_registry.tokenizer import load_tokenizer

    methods = [m for m in args.methods.split(",") if m]
    datasets = list(DATASETS) if args.dataset == "all" else args.dataset.split(",")
    for dataset in datasets:
        if dataset not in DATASETS:
            raise SystemExit(f"--dataset {dataset!r}: one of {', '.join(DATASETS)}, all, or a comma-separated list")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    engine_args: dict[str, Any] = dict(model=args.model, max_num_seqs=max(batch_sizes), seed=args.seed)
    if args.num_kv_blocks:
        engine_args["num_kv_blocks"] = args.num_kv_blocks
    if args.tokenizer:
        engine_args["tokenizer"] = args.tokenizer
    if args.dtype:
        engine_args["dtype"] = args.dtype
    if args.async_scheduling:
        engine_args["async_scheduling"] = True

    results: list[SpecRunResult] = []
    total = len(datasets) * (len(methods) + 1) * len(batch_sizes)
    progress = tqdm(total=total, disable=args.disable_tqdm, desc="bench spec", file=sys.stderr)
    for dataset in datasets:
        prompts = build_prompts(dataset, args.num_prompts, tokenizer, seed=args.seed)
        baseline: dict[int, float] = {}
        for method in ["none", *methods]:
            extra: dict[str, Any] = {}
            if method != "none":
                extra["speculative_config"] = _speculative_config(method, args)
                if args.policy:
                    extra["speculative_config"]["policy"] = args.policy
                if args.disable_by_batch_size:
                    extra["speculative_config"]["disable_by_batch_size"] = args.disable_by_batch_size
            llm = LLM(**engine_args, **extra)
            for batch_size in batch_sizes:
                progress.set_postfix_str(f"{dataset} {method} bs={batch_size}")
                # Warm-up with the timed run's first batch: the graphs of
                # this batch size's shapes (decode, and verify per query
                # length) are captured on first use, which must not land in
                # the timed run, and the policy starts from its measurements.
                _run(llm, prompts[:batch_size], batch_size, args.output_len)
                num_tokens, elapsed, stats = _run(llm, prompts, batch_size, args.output_len)
                result = SpecRunResult(
                    method=method, dataset=dataset, batch_size=batch_size, num_prompts=len(prompts),
                    output_tokens=num_tokens, elapsed_s=elapsed, output_tok_s=num_tokens / elapsed,
                    async_scheduling=args.async_scheduling,
                )
                if method == "none":
                    baseline[batch_size] = result.output_tok_s
                else:
                    result.baseline_tok_s = baseline.get(batch_size)
                    if result.baseline_tok_s:
                        result.speedup = result.output_tok_s / result.baseline_tok_s
                if stats is not None:
                    _add_step_split(result, stats)
                results.append(result)
                progress.update(1)
                if args.result_file:  # partial results survive an interrupted run
                    _write_results(args, results)
            del llm
    progress.close()
    return results


def format_table(results: list[SpecRunResult], k: int) -> str:
    header = (
        f"{'dataset':<8} {'method':<12} {'bs':>3} {'tok/s':>9} {'speedup':>8} {'accept':>7} {'mean len':>8} "
        f"{'draft ms':>8} {'verify ms':>9} {'rest ms':>7} {'drafted':>7}  per-position acceptance (k={k})"
    )
    lines = [header, "-" * len(header)]
    if any(r.async_scheduling for r in results):
        lines.insert(0, "async scheduling (every engine, no speculation included)")
    for r in results:
        speedup = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
        accept = f"{r.acceptance_rate:.3f}" if r.acceptance_rate is not None else "-"
        mean_len = f"{r.mean_acceptance_length:.2f}" if r.mean_acceptance_length is not None else "-"
        split = [f"{ms:.2f}" if ms is not None else "-" for ms in (r.draft_ms, r.verify_ms, r.rest_ms)]
        drafted = f"{r.drafted_fraction:.2f}" if r.drafted_fraction is not None else "-"
        per_pos = " ".join(f"{p:.2f}" for p in r.per_position_acceptance)
        lines.append(
            f"{r.dataset:<8} {r.method:<12} {r.batch_size:>3} {r.output_tok_s:>9.1f} {speedup:>8} {accept:>7} "
            f"{mean_len:>8} {split[0]:>8} {split[1]:>9} {split[2]:>7} {drafted:>7}  {per_pos}"
        )
    return "\n".join(lines)


def _positive_int(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} must be an integer >= 1")
    return number


def add_spec_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench spec`` under the ``bench`` command of ``sub`` (the
    ``pagedllm`` subparsers, after ``add_bench_parser``)."""
    bench = sub.choices["bench"]
    bench_sub = next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction))
    spec = bench_sub.add_parser(
        "spec", allow_abbrev=False, help="speculative decoding: acceptance and speedup vs no speculation",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    spec.add_argument("--model", default="tiny", help="target model (folder, hub id or shipped alias)")
    spec.add_argument("--tokenizer", default=None)
    spec.add_argument("--dtype", default=None)
    spec.add_argument("--methods", default="ngram,draft_model,eagle",
                      help="comma-separated drafter names (registered speculative.method values: "
                      "ngram, suffix, draft_model, eagle, a plugin's)")
    spec.add_argument("--draft-model", default=None, help="default: the shipped tiny-draft")
    spec.add_argument("--eagle-model", default=None, help="default: the shipped tiny-eagle")
    spec.add_argument("--speculative-model", default=None, help="speculative.model for a plugin drafter")
    spec.add_argument("--num-speculative-tokens", "-k", type=_positive_int, default=4)
    spec.add_argument("--prompt-lookup-min", type=_positive_int, default=1)
    spec.add_argument("--prompt-lookup-max", type=_positive_int, default=4)
    spec.add_argument("--dataset", default="all", help=f"{', '.join(DATASETS)}, all, or a comma-separated list")
    spec.add_argument("--num-prompts", type=_positive_int, default=16)
    spec.add_argument("--output-len", type=_positive_int, default=128)
    spec.add_argument("--batch-sizes", default="1,8,32")
    spec.add_argument("--policy", default=None,
                      help="speculative.policy (adaptive, batch_size, always, or a plugin's); default: the engine's")
    spec.add_argument("--disable-by-batch-size", type=_positive_int, default=None,
                      help="speculative.disable_by_batch_size (vLLM's)")
    spec.add_argument("--num-kv-blocks", type=_positive_int, default=None)
    spec.add_argument("--async-scheduling", action="store_true",
                      help="run every engine (no speculation too) with scheduler.async_scheduling")
    spec.add_argument("--seed", type=int, default=0)
    spec.add_argument("--result-file", default=None, help="write every row as JSON here")
    spec.add_argument("--disable-tqdm", action="store_true")
    spec.set_defaults(func=cmd_bench_spec)


def _write_results(args: argparse.Namespace, results: list[SpecRunResult]) -> None:
    with open(args.result_file, "w", encoding="utf-8") as handle:
        json.dump({"config": {k: v for k, v in vars(args).items() if k != "func"},
                   "results": [asdict(r) for r in results]}, handle, indent=2)


def cmd_bench_spec(args: argparse.Namespace) -> int:
    results = run_bench(args)
    print(format_table(results, args.num_speculative_tokens))
    if args.result_file:
        _write_results(args, results)
    return 0
