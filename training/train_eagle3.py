"""Train an EAGLE-3 head for a Llama target on CPU, saved in vLLM's EAGLE-3
layout (config.json + model.safetensors) that `Eagle3Drafter` loads.

    python -m pagedllm.training.train_eagle3 --target tiny --minutes 5 --out /tmp/train/pagedllm-tiny-eagle3

Data: the target's hidden states entering layers (2, L // 2, L - 3) and its
next-token distributions over the train split of the tiny corpus (the same
windows as train_eagle.py). Training-time test (EAGLE-3): the head is
unrolled `--ttt-steps` times; step j feeds back its own step j - 1 features
and reads the tokens one further on, its attention seeing the target-fed
step's keys causally and each later step's key at the same row only (what
drafting sees at inference). Loss: cross-entropy against the target's
distribution restricted to the draft vocabulary (its most frequent tokens),
weighted 0.8^j per step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pagedllm.model_registry.layers.rotary import RotaryEmbedding, apply_rotary_emb, get_rope_parameters
from pagedllm.training.train_eagle import _MLP, _RMSNorm, _train_tokens


class _Eagle3Attention(nn.Module):
    """q/k/v over [embedding; feature] (2H); keys of earlier unrolled steps passed in."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(2 * hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: list[Any]) -> torch.Tensor:
        """x [B, S, 2H]; cache: (k, v) of the earlier steps, appended to."""
        batch, seq, _ = x.shape
        q = apply_rotary_emb(self.q_proj(x).view(batch * seq, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary_emb(self.k_proj(x).view(batch * seq, self.num_kv_heads, self.head_dim), cos, sin)
        groups = self.num_heads // self.num_kv_heads
        k = k.view(batch, seq, self.num_kv_heads, self.head_dim).repeat_interleave(groups, 2).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim).repeat_interleave(groups, 2)
        cache.append((k, v.transpose(1, 2)))
        q = q.view(batch, seq, self.num_heads, self.head_dim).transpose(1, 2)  # [B, h, S, d]
        scale = self.head_dim**-0.5
        k0, v0 = cache[0]
        scores = [(q @ k0.transpose(-1, -2) * scale).masked_fill(
            torch.ones(seq, seq, dtype=torch.bool, device=x.device).triu(1), float("-inf"))]
        # Each later step's key at the query's own row (the drafts before it at inference).
        scores += [(q * k_i).sum(-1, keepdim=True) * scale for k_i, _ in cache[1:]]
        probs = torch.cat(scores, dim=-1).softmax(-1)
        out = probs[..., :seq] @ v0
        for i, (_, v_i) in enumerate(cache[1:]):
            out = out + probs[..., seq + i : seq + i + 1] * v_i
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class _Eagle3Layer(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = _RMSNorm(config.hidden_size, eps)
        self.hidden_norm = _RMSNorm(config.hidden_size, eps)
        self.self_attn = _Eagle3Attention(config)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, eps)
        self.mlp = _MLP(config)


class TrainableEagle3Head(nn.Module):
    """Plain-torch EAGLE-3 head whose state_dict names are vLLM's checkpoint's."""

    d2t: torch.Tensor

    def __init__(self, config: Any, num_aux_layers: int, draft_ids: torch.Tensor) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(num_aux_layers * hidden, hidden, bias=False)
        self.midlayer = _Eagle3Layer(config)
        self.norm = _RMSNorm(hidden, config.rms_norm_eps)
        self.lm_head = nn.Linear(hidden, len(draft_ids), bias=False)
        self.register_buffer("d2t", draft_ids - torch.arange(len(draft_ids)))
        self.register_buffer("t2d", torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, draft_ids, True))
        head_dim = self.midlayer.self_attn.head_dim
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, get_rope_parameters(config))

    def step(
        self, embeds: torch.Tensor, features: torch.Tensor, offset: int, cache: list[Any]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One unrolled step over [B, S, H] rows at positions offset..offset+S-1:
        (draft logits [B, S, Vd], features fed back [B, S, H])."""
        batch, seq, _ = embeds.shape
        cos, sin = self.rotary_emb((torch.arange(seq) + offset).repeat(batch))
        layer = self.midlayer
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(features)], dim=-1)
        residual = layer.self_attn(x, cos, sin, cache) + features
        out = layer.mlp(layer.post_attention_layernorm(residual)) + residual
        return self.lm_head(self.norm(out)), out


def eagle3_config(target_config: dict[str, Any], draft_vocab_size: int, aux_ids: list[int]) -> dict[str, Any]:
    config = dict(target_config)
    config.update(
        architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=draft_vocab_size,
        target_hidden_size=target_config["hidden_size"], tie_word_embeddings=False,
        eagle_config={"eagle_aux_hidden_state_layer_ids": aux_ids, "use_aux_hidden_state": True},
    )
    return config


def _draft_vocabulary(tokens: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` most frequent tokens of the training data, sorted."""
    counts = Counter(tokens.tolist())
    return torch.tensor(sorted(t for t, _ in counts.most_common(size)), dtype=torch.long)


def _ttt_loss(head: TrainableEagle3Head, embed: nn.Module, windows: torch.Tensor, aux: torch.Tensor,
              target_logits: torch.Tensor, ttt_steps: int) -> tuple[torch.Tensor, float]:
    """windows [B, S + 1]; aux, target_logits at positions 0..S-1. Row t of step j
    reads token t + 1 + j and predicts token t + 2 + j."""
    seq = windows.shape[1] - 1
    draft_ids = torch.arange(head.lm_head.out_features) + head.d2t
    target = target_logits[..., draft_ids].softmax(-1)  # [B, S, Vd] the target restricted to the draft vocab
    features = head.fc(aux)
    cache: list[Any] = []
    loss = torch.zeros(())
    accuracy = 0.0
    for j in range(ttt_steps):
        rows = seq - 1 - j  # rows whose predicted token is in the window
        tokens = torch.cat([windows[:, 1 + j :], windows[:, -1:].expand(-1, j)], dim=1)[:, :seq]
        logits, features = head.step(embed(tokens), features, j, cache)
        log_probs = logits[:, :rows].log_softmax(-1)
        loss = loss + 0.8**j * -(target[:, 1 + j : 1 + j + rows] * log_probs).sum(-1).mean()
        if j == 0:
            accuracy = (logits[:, :rows].argmax(-1) == target[:, 1 : 1 + rows].argmax(-1)).float().mean().item()
    return loss, accuracy


def train(target: str, out_dir: Path, *, minutes: float, seq_len: int, batch_size: int, lr: float, seed: int,
          ttt_steps: int, draft_vocab_size: int, max_files: int | None = None) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pagedllm.model_registry.tiny import resolve_model_path

    target_dir = Path(resolve_model_path(target))
    target_config = json.loads((target_dir / "config.json").read_text())
    num_layers = target_config["num_hidden_layers"]
    aux_ids = [2, num_layers // 2, num_layers - 3]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    embed = model.get_input_embeddings()
    tokens = torch.tensor(_train_tokens(max_files), dtype=torch.long)
    config = eagle3_config(target_config, draft_vocab_size, aux_ids)
    head = TrainableEagle3Head(LlamaConfig(**config), len(aux_ids), _draft_vocabulary(tokens, draft_vocab_size))
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    started = time.time()
    deadline, step = started + minutes * 60, 0
    while time.time() < deadline:
        for group in optimizer.param_groups:
            group["lr"] = lr * (1.0 - 0.9 * (time.time() - started) / (deadline - started))
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
        windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])
        with torch.no_grad():
            out = model(input_ids=windows[:, :-1], output_hidden_states=True)  # hidden_states[i]: layer i's input
            aux = torch.cat([out.hidden_states[i] for i in aux_ids], dim=-1)
        loss, accuracy = _ttt_loss(head, embed, windows, aux, out.logits, ttt_steps)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.4f} top1-agree(step 0) {accuracy:.3f}", flush=True)
        step += 1
    save(head, dict(config, torch_dtype="float16"), out_dir)
    command = "python -m pagedllm.training.train_eagle3 " + " ".join(sys.argv[1:])
    (out_dir / "README.md").write_text(
        f"# pagedllm-tiny-eagle3\n\nAn EAGLE-3 head for `{target_dir.name}` (aux layers {aux_ids}, draft vocabulary "
        f"{draft_vocab_size}), trained by `{command}` ({step} steps of {batch_size} x {seq_len} tokens, "
        f"{ttt_steps} training-time-test steps, {minutes:g} minutes, {torch.get_num_threads()} torch thread(s), "
        f"lr {lr}, seed {seed}).\n"
    )
    print(f"saved {out_dir} after {step} steps", flush=True)


def save(head: TrainableEagle3Head, config: dict[str, Any], out_dir: Path) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {
        k: (v.detach().half() if v.is_floating_point() else v).contiguous()
        for k, v in head.state_dict().items() if "rotary_emb" not in k
    }
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ttt-steps", type=int, default=3)
    parser.add_argument("--draft-vocab-size", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--max-files", type=int, default=None, help="train on a sample of the split's files")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    train(args.target, args.out, minutes=args.minutes, seq_len=args.seq_len, batch_size=args.batch_size,
          lr=args.lr, seed=args.seed, ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size,
          max_files=args.max_files)


if __name__ == "__main__":
    main()
