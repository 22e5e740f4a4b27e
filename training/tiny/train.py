"""Train the embedded model family on CPU, reproducibly.

    python -m pagedllm.training.tiny.train --which target --steps N --seed S --out DIR

The model is Hugging Face's own `LlamaForCausalLM`, so the saved folder (HF
layout, float16 safetensors, the project tokenizer beside it) loads unchanged
in transformers, vLLM and pagedllm. The recipe: 256-token windows of the
train split's token stream (each epoch visits every window once, in random
order), AdamW, bfloat16 autocast, linear warmup then cosine decay, a
fixed seed and a fixed step count. Beside the weights it writes
training_stats.json (command, seed, steps, tokens seen, wall time, losses);
`python -m pagedllm.training.tiny.evaluate --write-cards` then measures
the shipped weights and writes the README.md model cards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.model_registry.tiny.tokenizer import (
    BOS_TOKEN,
    EOS_TOKEN,
    MODEL_MAX_LENGTH,
    PAD_TOKEN,
    VOCAB_SIZE,
)

if TYPE_CHECKING:
    import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@dataclass(frozen=True)
class ModelShape:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int


@dataclass(frozen=True)
class Recipe:
    shape: ModelShape
    seq_len: int = 256
    batch_size: int = 16
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    # bfloat16 autocast for the forward pass (float32 master weights and
    # optimizer): 1.36x the tokens/s of float32 on this machine's avx512_bf16.
    autocast_bf16: bool = False


MODEL_NAMES = {"target": "pagedllm-tiny", "draft": "pagedllm-tiny-draft"}
RECIPES = {
    # ~6.5M parameters (tied embeddings: 2.1M of them are the 8,192 x 256 table).
    "target": Recipe(ModelShape(256, 688, 6, 4, 2), peak_lr=5e-3, warmup_steps=100, autocast_bf16=True),
    # ~1.4M parameters, under a quarter of the target's.
    "draft": Recipe(ModelShape(128, 344, 2, 4, 2), peak_lr=6e-3, warmup_steps=80),
}


def llama_config(shape: ModelShape, token_ids: dict[str, int]) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": shape.hidden_size,
        "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.hidden_size // shape.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-5,
        # Both spellings: transformers 5 reads rope_parameters, 4.x rope_theta.
        "rope_theta": 10000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": True,
        "bos_token_id": token_ids[BOS_TOKEN],
        "eos_token_id": token_ids[EOS_TOKEN],
        "pad_token_id": token_ids[PAD_TOKEN],
        "torch_dtype": "float16",
        "use_cache": True,
    }


def lr_at(step: int, total_steps: int, recipe: Recipe) -> float:
    if step < recipe.warmup_steps:
        return recipe.peak_lr * (step + 1) / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(1, total_steps - recipe.warmup_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
    return recipe.peak_lr * (recipe.min_lr_ratio + (1.0 - recipe.min_lr_ratio) * cosine)


def epoch_windows(num_tokens: int, seq_len: int, count: int, generator: torch.Generator) -> torch.Tensor:
    """`count` window start offsets: every epoch visits each non-overlapping
    window of the stream once, in a fresh random order, at a random phase
    (so window boundaries move between epochs). Full coverage: random
    offsets with replacement leave a third of the data unseen after one
    epoch's worth of windows."""
    import torch

    epochs = []
    total = 0
    while total < count:
        phase = int(torch.randint(0, seq_len, (1,), generator=generator))
        starts = torch.arange(phase, num_tokens - seq_len - 1, seq_len)
        epochs.append(starts[torch.randperm(len(starts), generator=generator)])
        total += len(starts)
    return torch.cat(epochs)[:count]


def train(
    which: str,
    steps: int,
    seed: int,
    out_dir: Path,
    tokenizer_dir: Path,
    *,
    threads: int,
    log_every: int,
    init_from: Path | None = None,
    peak_lr: float | None = None,
) -> None:
    """Train `which` for `steps` steps and save it in `out_dir`.

    `init_from` continues from a saved folder of the same model (a second
    stage: its weights, a fresh optimizer and schedule); the stage before is
    kept in training_stats.json under "previous_stage".
    """
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from pagedllm.model_registry.tiny.tokenizer import special_token_ids
    from pagedllm.training.tiny.evaluate import perplexity, validation_windows
    from pagedllm.training.tiny.tokenizer import token_stream

    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    recipe = RECIPES[which]
    token_ids = special_token_ids(tokenizer_dir)
    config = llama_config(recipe.shape, token_ids)
    hf_config = LlamaConfig(**{**config, "torch_dtype": "float32"})
    hf_config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(hf_config).float()
    previous_stage = None
    if init_from is not None:
        from safetensors.torch import load_file

        weights = {name: tensor.float() for name, tensor in load_file(str(init_from / "model.safetensors")).items()}
        model.load_state_dict(weights, strict=False)  # lm_head is tied to embed_tokens
        model.tie_weights()
        previous_stage = json.loads((init_from / "training_stats.json").read_text(encoding="utf-8"))
    if peak_lr is not None:
        recipe = dataclasses.replace(recipe, peak_lr=peak_lr)
    num_params = sum(p.numel() for p in model.parameters())
    log(f"[{which}] parameters: {num_params:,} ({config})")

    train_ids = torch.tensor(token_stream("train", tokenizer_dir), dtype=torch.long)
    val_windows, bos_id = validation_windows(tokenizer_dir)
    num_val_tokens = sum(len(window) for window in val_windows)
    log(f"[{which}] train tokens: {len(train_ids):,}; validation tokens (encodings/ left out): {num_val_tokens:,}")

    model.eval()
    untrained = perplexity(model, val_windows, bos_id)
    untrained_nll, num_val_tokens = untrained.loss, untrained.num_tokens
    label = "start" if init_from else "untrained"
    log(f"[{which}] {label}: val loss {untrained_nll:.4f} ppl {math.exp(untrained_nll):.1f}")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.peak_lr,
        betas=(0.9, 0.95),
    )
    generator = torch.Generator().manual_seed(seed)
    window = recipe.seq_len + 1
    windows = epoch_windows(len(train_ids), recipe.seq_len, recipe.batch_size * steps, generator)
    model.train()
    started = time.perf_counter()
    running_loss = 0.0
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, recipe)
        offsets = windows[step * recipe.batch_size : (step + 1) * recipe.batch_size]
        batch = torch.stack([train_ids[offset : offset + window] for offset in offsets.tolist()])
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=recipe.autocast_bf16):
            logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        optimizer.step()
        running_loss += loss.item()
        if (step + 1) % log_every == 0 or step + 1 == steps:
            elapsed = time.perf_counter() - started
            tokens = (step + 1) * recipe.batch_size * recipe.seq_len
            log(
                f"[{which}] step {step + 1}/{steps} loss {running_loss / log_every:.4f} "
                f"lr {optimizer.param_groups[0]['lr']:.2e} {tokens / elapsed:,.0f} tok/s {elapsed:.0f}s"
            )
            running_loss = 0.0
    train_seconds = time.perf_counter() - started
    tokens_seen = steps * recipe.batch_size * recipe.seq_len

    model.eval()
    trained_nll = perplexity(model, val_windows, bos_id).loss
    log(f"[{which}] trained: val loss {trained_nll:.4f} ppl {math.exp(trained_nll):.2f} after {train_seconds:.0f}s")

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    _write_json(out_dir / "config.json", config)
    _write_json(
        out_dir / "generation_config.json",
        {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")},
    )
    # NOTE: tied embeddings: only embed_tokens is saved (HF and vLLM re-tie lm_head).
    state = {
        name: tensor.detach().to(torch.float16).contiguous()
        for name, tensor in model.state_dict().items()
        if name != "lm_head.weight"
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    start_key = "untrained" if init_from is None else "start"
    stats = {
        "model": MODEL_NAMES[which],
        "command": "python -m pagedllm.training.tiny.train " + " ".join(sys.argv[1:]),
        "seed": seed,
        "steps": steps,
        "batch_size": recipe.batch_size,
        "seq_len": recipe.seq_len,
        "tokens_seen": tokens_seen,
        "train_tokens_in_corpus": len(train_ids),
        "train_wall_seconds": round(train_seconds, 1),
        "threads": threads,
        "num_parameters": num_params,
        "validation_tokens": num_val_tokens,
        "eval_window": len(val_windows[0]),
        # The first stage starts from the seeded random weights, a later one from `init_from`'s.
        f"{start_key}_val_loss": round(untrained_nll, 4),
        f"{start_key}_val_ppl": round(math.exp(untrained_nll), 2),
        "trained_val_loss_float32": round(trained_nll, 4),
        "trained_val_ppl_float32": round(math.exp(trained_nll), 2),
        "recipe": {
            "peak_lr": recipe.peak_lr,
            "min_lr_ratio": recipe.min_lr_ratio,
            "warmup_steps": recipe.warmup_steps,
            "weight_decay": recipe.weight_decay,
            "grad_clip": recipe.grad_clip,
            "autocast_bf16": recipe.autocast_bf16,
            "window_sampling": "epochs",
            "betas": [0.9, 0.95],
        },
        "previous_stage": previous_stage,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
    }
    _write_json(out_dir / "training_stats.json", stats)
    log(f"[{which}] saved {out_dir}")


def log(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--which", choices=sorted(RECIPES), required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tokenizer-dir", type=Path, default=None,
                        help="a saved tokenizer (default: train it, the same bytes as the shipped one)")
    parser.add_argument("--init-from", type=Path, default=None, help="continue from this saved folder")
    parser.add_argument("--peak-lr", type=float, default=None, help="override the recipe's peak learning rate")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--log-every", type=int, default=50)
    args = parser.parse_args(argv)
    if args.tokenizer_dir is not None:
        train(args.which, args.steps, args.seed, args.out, args.tokenizer_dir, threads=args.threads,
              log_every=args.log_every, init_from=args.init_from, peak_lr=args.peak_lr)
        return
    from pagedllm.training.tiny.tokenizer import train_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        train_tokenizer(Path(tmp))
        train(args.which, args.steps, args.seed, args.out, Path(tmp), threads=args.threads,
              log_every=args.log_every, init_from=args.init_from, peak_lr=args.peak_lr)


if __name__ == "__main__":
    main()
