"""Give an EAGLE head a reduced draft vocabulary: the N most frequent tokens
of the tiny corpus' train split (FR-Spec, Zhao et al., 2025), in the
EAGLE-3 checkpoint layout (`draft_vocab_size` in config.json; `d2t` and
`t2d` beside the head's weights in model.safetensors).

    python -m pagedllm.training.draft_vocab --head model_registry/tiny/weights/pagedllm-tiny-eagle \
        --draft-vocab-size 1024 [--out DIR]

Without --out the head's folder is rewritten in place (its weights are
kept as they are). The EAGLE drafter then scores drafts with the target's
lm_head rows of those tokens only (spec_decode/draft_vocab.py).
"""

from __future__ import annotations

import argparse
import json
import shutil
from collections import Counter
from pathlib import Path

import torch


def most_frequent_tokens(token_ids: list[int], vocab_size: int, num_tokens: int) -> torch.Tensor:
    """The `num_tokens` most frequent ids (ties: the smaller id first), sorted."""
    counts = Counter(token_ids)
    ranked = sorted(range(vocab_size), key=lambda token: (-counts.get(token, 0), token))
    return torch.tensor(sorted(ranked[:num_tokens]), dtype=torch.long)


def draft_vocab_tensors(target_ids: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """vLLM's / SpecForge's tensors: d2t (target id - draft id) and t2d (a
    mask of the target ids in the draft vocabulary)."""
    d2t = target_ids - torch.arange(len(target_ids))
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[target_ids] = True
    return {"d2t": d2t, "t2d": t2d}


def write_draft_vocab(head_dir: Path, out_dir: Path, target_ids: torch.Tensor) -> None:
    from safetensors.torch import load_file, save_file

    config = json.loads((head_dir / "config.json").read_text())
    weights = {name: tensor for name, tensor in load_file(str(head_dir / "model.safetensors")).items()
               if name not in ("d2t", "t2d")}
    weights.update(draft_vocab_tensors(target_ids, config["vocab_size"]))
    config["draft_vocab_size"] = len(target_ids)
    if out_dir != head_dir:
        shutil.copytree(head_dir, out_dir, dirs_exist_ok=True)
    save_file(weights, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    from pagedllm.training.train_eagle import _train_tokens

    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--head", type=Path, required=True, help="an EAGLE head's folder")
    parser.add_argument("--draft-vocab-size", type=int, required=True)
    parser.add_argument("--out", type=Path, default=None, help="default: rewrite --head in place")
    args = parser.parse_args(argv)
    vocab_size = json.loads((args.head / "config.json").read_text())["vocab_size"]
    if not 0 < args.draft_vocab_size <= vocab_size:
        parser.error(f"--draft-vocab-size={args.draft_vocab_size} must be in 1..{vocab_size} (the vocab size)")
    target_ids = most_frequent_tokens(_train_tokens(None), vocab_size, args.draft_vocab_size)
    write_draft_vocab(args.head, args.out or args.head, target_ids)
    print(f"{args.out or args.head}: draft vocabulary of {args.draft_vocab_size} of {vocab_size} tokens")


if __name__ == "__main__":
    main()
