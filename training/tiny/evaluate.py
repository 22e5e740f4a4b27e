"""Measure the shipped models on the validation files (`encodings/` left out).

    python -m pagedllm.training.tiny.evaluate [--threads N] [--write-cards]

prints each model's per-token validation loss and perplexity, before (the
seeded initial weights) and after training, and, as a first measure of draft
quality, the fraction of positions where the draft's and the target's greedy
next tokens agree. `--write-cards` also writes each folder's README.md model
card from those figures and the folder's training_stats.json. Everything runs in float32 through Hugging
Face transformers, on the same non-overlapping 256-token windows the training
script scores.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from pagedllm.model_registry.tiny.tokenizer import BOS_TOKEN

if TYPE_CHECKING:
    import torch

EVAL_WINDOW = 256  # the training sequence length: positions past it were never trained


class Perplexity(NamedTuple):
    loss: float  # mean NLL per predicted token, in nats
    perplexity: float
    num_tokens: int


def load_float32(model_dir: Path) -> torch.nn.Module:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def validation_windows(tokenizer_dir: Path, window: int = EVAL_WINDOW) -> tuple[list[torch.Tensor], int]:
    """(windows, BOS id): the validation files (without `encodings/`), each
    preceded by BOS, concatenated and cut into non-overlapping `window`-token
    pieces; the tail is one shorter piece, so every token is covered."""
    import torch

    from pagedllm.model_registry.tiny.tokenizer import special_token_ids
    from pagedllm.training.tiny.tokenizer import token_stream

    stream = torch.tensor(token_stream("validation", tokenizer_dir, for_metric=True), dtype=torch.long)
    bos_id = special_token_ids(tokenizer_dir)[BOS_TOKEN]
    windows = list(stream.split(window))
    if len(windows[-1]) < 2:  # nothing to predict in a 1-token tail
        windows.pop()
    return windows, bos_id


def _batches(windows: list[torch.Tensor], batch_size: int) -> list[list[torch.Tensor]]:
    # Full windows batch together; the short tail runs alone (no padding needed).
    full = [w for w in windows if len(w) == len(windows[0])]
    short = [w for w in windows if len(w) != len(windows[0])]
    return [full[i : i + batch_size] for i in range(0, len(full), batch_size)] + [[w] for w in short]


def _summed_nll(logits: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    """Summed cross-entropy of `logits` [B, L, V] at `targets` [B, L] (-100:
    not scored), and how many positions were scored."""
    import torch

    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return nll.item(), int((targets != -100).sum())


def perplexity(model: torch.nn.Module, windows: list[torch.Tensor], bos_id: int, batch_size: int = 8) -> Perplexity:
    """Every token but a window's first is predicted, except BOS (a file
    boundary, not something to predict)."""
    import torch

    total_nll, total_tokens = 0.0, 0
    with torch.inference_mode():
        for batch in _batches(windows, batch_size):
            input_ids = torch.stack(batch)  # [B, L]
            logits = model(input_ids=input_ids).logits[:, :-1].float()  # [B, L-1, V]
            targets = input_ids[:, 1:].masked_fill(input_ids[:, 1:] == bos_id, -100)
            nll, num_tokens = _summed_nll(logits, targets)
            total_nll, total_tokens = total_nll + nll, total_tokens + num_tokens
    loss = total_nll / total_tokens
    return Perplexity(loss, math.exp(loss), total_tokens)


def sliding_perplexity(
    model: torch.nn.Module, stream: torch.Tensor, bos_id: int, context: int = EVAL_WINDOW,
    stride: int = EVAL_WINDOW // 2, batch_size: int = 8,
) -> Perplexity:
    """Perplexity with a sliding window (Hugging Face's "perplexity of
    fixed-length models" method): windows of `context` tokens every `stride`
    tokens; each token is scored once, in the first window that reaches it
    past the previous window's end, so every scored token but the first
    `context` has at least `context - stride` tokens before it. BOS (a file
    boundary) is never a target."""
    import torch

    starts = list(range(0, max(1, len(stream) - context + 1), stride))
    if starts[-1] + context < len(stream):
        starts.append(len(stream) - context)
    jobs = []  # (start, first in-window position scored)
    covered = 1  # stream[0] has no context: never a target
    for start in starts:
        end = min(start + context, len(stream))
        if end > covered:
            jobs.append((start, max(covered, start + 1) - start))
            covered = end
    total_nll, total_tokens = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(jobs), batch_size):
            chunk = jobs[i : i + batch_size]
            length = min(context, len(stream) - chunk[0][0])
            same = [job for job in chunk if min(context, len(stream) - job[0]) == length]
            rest = [job for job in chunk if job not in same]
            for group in ([same] if same else []) + [[job] for job in rest]:
                group_length = min(context, len(stream) - group[0][0])
                input_ids = torch.stack([stream[start : start + group_length] for start, _ in group])
                logits = model(input_ids=input_ids).logits[:, :-1].float()
                targets = input_ids[:, 1:].clone()
                for row, (_, first) in enumerate(group):
                    targets[row, : first - 1] = -100  # scored by an earlier window
                targets = targets.masked_fill(targets == bos_id, -100)
                nll, num_tokens = _summed_nll(logits, targets)
                total_nll, total_tokens = total_nll + nll, total_tokens + num_tokens
    loss = total_nll / total_tokens
    return Perplexity(loss, math.exp(loss), total_tokens)


def greedy_agreement(
    target: torch.nn.Module, draft: torch.nn.Module, windows: list[torch.Tensor], batch_size: int = 8
) -> float:
    """Fraction of positions (every window position with a next token) where
    both models' argmax next tokens are the same."""
    import torch

    agree, total = 0, 0
    with torch.inference_mode():
        for batch in _batches(windows, batch_size):
            input_ids = torch.stack(batch)[:, :-1]
            target_next = target(input_ids=input_ids).logits.argmax(dim=-1)
            draft_next = draft(input_ids=input_ids).logits.argmax(dim=-1)
            agree += int((target_next == draft_next).sum())
            total += target_next.numel()
    return agree / total


def untrained_model(model_dir: Path, seed: int) -> torch.nn.Module:
    """The weights training started from: the same config, the same seed,
    built the way `train.py` builds them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**config, "torch_dtype": "float32"})).float().eval()


def main(argv: list[str] | None = None) -> None:
    import torch

    from pagedllm.model_registry.tiny import DRAFT_MODEL_NAME, TARGET_MODEL_NAME, get_tiny_model_dir
    from pagedllm.training.tiny.model_card import write_model_card

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--target", type=Path, default=get_tiny_model_dir(TARGET_MODEL_NAME))
    parser.add_argument("--draft", type=Path, default=get_tiny_model_dir(DRAFT_MODEL_NAME))
    parser.add_argument("--write-cards", action="store_true", help="write README.md in both folders")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    windows, bos_id = validation_windows(args.target)
    stream = torch.cat(windows)
    target, draft = load_float32(args.target), load_float32(args.draft)
    figures: dict[Path, dict[str, float]] = {}
    for name, model_dir, model in ((TARGET_MODEL_NAME, args.target, target), (DRAFT_MODEL_NAME, args.draft, draft)):
        stats = json.loads((model_dir / "training_stats.json").read_text(encoding="utf-8"))
        started = time.perf_counter()
        trained = perplexity(model, windows, bos_id)
        eval_seconds = time.perf_counter() - started
        untrained = perplexity(untrained_model(model_dir, stats["seed"]), windows, bos_id)
        sliding = sliding_perplexity(model, stream, bos_id)
        print(f"{name}: val loss {trained.loss:.4f}, perplexity {trained.perplexity:.2f} "
              f"(untrained {untrained.loss:.4f}, {untrained.perplexity:.1f}) over {trained.num_tokens:,} tokens; "
              f"sliding window (stride {EVAL_WINDOW // 2}): loss {sliding.loss:.4f}, perplexity "
              f"{sliding.perplexity:.2f} [{eval_seconds:.0f}s]")
        figures[model_dir] = {
            "sliding_val_loss": sliding.loss,
            "sliding_val_ppl": sliding.perplexity,
            "val_loss": trained.loss,
            "val_ppl": trained.perplexity,
            "untrained_val_loss": untrained.loss,
            "untrained_val_ppl": untrained.perplexity,
            "val_tokens": trained.num_tokens,
        }
    agreement = greedy_agreement(target, draft, windows)
    print(f"greedy next-token agreement (draft vs target): {agreement:.4f}")
    if args.write_cards:
        for model_dir, model_figures in figures.items():
            write_model_card(model_dir, {**model_figures, "greedy_agreement": agreement})


if __name__ == "__main__":
    main()
