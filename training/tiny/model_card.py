"""README.md model cards for the shipped models, written from the folder's
training_stats.json (what `train.py` recorded) and the figures `evaluate.py`
measured on the shipped weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

DESCRIPTIONS = {
    "pagedllm-tiny": (
        "The default model of pagedllm (`LLM()`, `pagedllm serve`): a small Llama trained from scratch on CPU "
        "on the Python standard library's sources. It continues Python code; it has never seen a chat "
        "transcript or prose beyond docstrings and comments, so the chat template only frames the prompt."
    ),
    "pagedllm-tiny-draft": (
        "A draft model for speculative-decoding experiments with `pagedllm-tiny`: the same tokenizer and "
        "training data, under a quarter of the parameters."
    ),
}
ALIASES = {"pagedllm-tiny": "tiny", "pagedllm-tiny-draft": "tiny-draft"}


def training_stages(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """The stages recorded in training_stats.json, first to last."""
    stages = []
    stage: dict[str, Any] | None = stats
    while stage is not None:
        stages.append(stage)
        stage = stage.get("previous_stage")
    return stages[::-1]


def _stage_rows(stages: list[dict[str, Any]]) -> list[str]:
    rows = []
    for number, stage in enumerate(stages, start=1):
        recipe = stage["recipe"]
        prefix = f"stage {number}: " if len(stages) > 1 else ""
        sampling = (
            "each epoch every window once, shuffled"
            if recipe.get("window_sampling") == "epochs"
            else "random windows, with replacement"
        )
        precision = "bfloat16 autocast, float32 weights" if recipe.get("autocast_bf16") else "float32"
        rows += [
            f"| {prefix}seed | {stage['seed']} |",
            f"| {prefix}steps | {stage['steps']:,} (batch {stage['batch_size']} x {stage['seq_len']} tokens, "
            f"{sampling}) |",
            f"| {prefix}precision | {precision} |",
            f"| {prefix}tokens seen | {stage['tokens_seen']:,} |",
            f"| {prefix}learning rate | {recipe['peak_lr']:g} peak, linear warmup {recipe['warmup_steps']} steps, "
            f"cosine decay to {recipe['min_lr_ratio']:g} x peak |",
            f"| {prefix}wall time | {stage['train_wall_seconds']:,.0f} s "
            f"({stage['train_wall_seconds'] / 60:.1f} min) |",
        ]
    return rows


def render_model_card(config: dict[str, Any], stats: dict[str, Any], figures: dict[str, float]) -> str:
    name = stats["model"]
    stages = training_stages(stats)
    recipe = stats["recipe"]
    total_tokens = sum(stage["tokens_seen"] for stage in stages)
    total_seconds = sum(stage["train_wall_seconds"] for stage in stages)
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        "license: apache-2.0",
        "---",
        "",
        f"# {name}",
        "",
        DESCRIPTIONS[name],
        "",
        f"Load it by path or, in pagedllm, by its alias: `LLM(model=\"{ALIASES[name]}\")`, "
        f"`pagedllm serve {ALIASES[name]}`. Hugging Face transformers and vLLM load the folder unchanged.",
        "",
        "## Architecture",
        "",
        "| | |",
        "|---|---|",
        "| architecture | `LlamaForCausalLM` |",
        f"| parameters | {stats['num_parameters']:,} (embeddings tied with the output layer) |",
        f"| hidden size / intermediate size | {config['hidden_size']} / {config['intermediate_size']} |",
        f"| layers | {config['num_hidden_layers']} |",
        f"| attention heads / KV heads / head dim | {config['num_attention_heads']} / "
        f"{config['num_key_value_heads']} / {config['head_dim']} |",
        f"| vocabulary | {config['vocab_size']:,} (byte-level BPE, shared by the family) |",
        f"| context | trained on {stats['seq_len']}-token windows; RoPE, max_position_embeddings "
        f"{config['max_position_embeddings']} |",
        "| weights | float16 safetensors |",
        "",
        "## Training",
        "",
        "```",
        *(stage["command"] for stage in stages),
        "```",
        "",
        *(
            [
                "`--tokenizer-dir` named a folder written by `train_tokenizer()`: the same bytes as the shipped "
                "tokenizer (without the flag the script trains that tokenizer itself).",
                "",
            ]
            if any("--tokenizer-dir" in stage["command"] for stage in stages)
            else []
        ),
        "| | |",
        "|---|---|",
        "| data | train split of the Python standard library's `*.py` sources (no site-packages), "
        f"{stats['train_tokens_in_corpus']:,} tokens; split by file with a SHA-256 of the path |",
        *_stage_rows(stages),
        f"| total | {total_tokens:,} tokens seen, {total_seconds:,.0f} s ({total_seconds / 60:.1f} min) of "
        f"training on a 2-core CPU, {stats['threads']} torch threads |",
        f"| optimizer | AdamW, betas {tuple(recipe['betas'])}, weight decay {recipe['weight_decay']} "
        f"(matrices only), gradient clip {recipe['grad_clip']} |",
        f"| software | Python {stats['python']}, torch {stats['torch']} |",
        "",
        "## Evaluation",
        "",
        "Per-token perplexity on the validation files (the other split), leaving out the generated codec "
        "tables under `encodings/` (near-copies of each other that every model scores about 2 on). Each file "
        f"is preceded by BOS; the stream is cut into non-overlapping {stats['seq_len']}-token windows and every "
        f"token but a window's first (and BOS) is scored: {int(figures['val_tokens']):,} tokens. The shipped "
        "float16 weights, computed in float32 (`python -m pagedllm.training.tiny.evaluate`).",
        "",
        "| | validation loss (nats/token) | perplexity |",
        "|---|---|---|",
        f"| untrained (seed {stats['seed']}) | {figures['untrained_val_loss']:.4f} | "
        f"{figures['untrained_val_ppl']:,.1f} |",
        f"| trained | {figures['val_loss']:.4f} | {figures['val_ppl']:.2f} |",
        *(
            [
                f"| trained, sliding window ({stats['seq_len']} tokens, stride {stats['seq_len'] // 2}) | "
                f"{figures['sliding_val_loss']:.4f} | {figures['sliding_val_ppl']:.2f} |",
            ]
            if "sliding_val_loss" in figures
            else []
        ),
        "",
        "The sliding-window row scores every token once with at least half a window of context (Hugging "
        "Face's method for fixed-length models); the non-overlapping windows above also score tokens at the "
        "very start of a window, with almost no context.",
        "",
        "For scale: a uniform guess over the vocabulary scores 8,192.",
        "",
        f"Greedy next tokens of `pagedllm-tiny-draft` and `pagedllm-tiny` agree on "
        f"{100 * figures['greedy_agreement']:.1f} % of the validation positions.",
        "",
        "## Limitations",
        "",
        "A few million parameters trained for minutes: it writes plausible-looking Python, not correct "
        "programs, and knows nothing outside the standard library's sources. For tests, demos and "
        "benchmarks of the serving engine, not for answering anything.",
        "",
    ]
    return "\n".join(lines)


def write_model_card(model_dir: Path, figures: dict[str, float]) -> None:
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    stats = json.loads((model_dir / "training_stats.json").read_text(encoding="utf-8"))
    (model_dir / "README.md").write_text(render_model_card(config, stats, figures), encoding="utf-8")
