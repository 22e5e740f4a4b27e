"""Train an EAGLE-1 head for a Llama target on CPU, saved in the Hugging Face
EAGLE layout (config.json + model.safetensors) that `EagleDrafter` loads.

    python -m pagedllm.training.train_eagle --target tiny --minutes 12 \
        --out model_registry/tiny/weights/pagedllm-tiny-eagle

Data: the target's own final hidden states over the train split of the tiny
corpus (teacher forcing). Loss (EAGLE-1): SmoothL1 between predicted and
actual next features + 0.1 x cross-entropy of the target's lm_head on the
predicted feature against the target's next-token distribution.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.model_registry.layers.rotary import RotaryEmbedding, apply_rotary_emb, get_rope_parameters


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class _Attention(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch * seq, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch * seq, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, seq, self.num_kv_heads, self.head_dim)
        q = apply_rotary_emb(q, cos, sin).view(batch, seq, self.num_heads, self.head_dim)
        k = apply_rotary_emb(k, cos, sin).view(batch, seq, self.num_kv_heads, self.head_dim)
        groups = self.num_heads // self.num_kv_heads
        k = k.repeat_interleave(groups, dim=2)
        v = v.repeat_interleave(groups, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class _MLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _Layer(nn.Module):
    """A Llama decoder layer without the input norm (EAGLE's first layer)."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = _RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class TrainableEagleHead(nn.Module):
    """Plain-torch EAGLE-1 head whose state_dict names are the checkpoint's."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        layer = _Layer(config)
        self.layers = nn.ModuleList([layer])
        head_dim = layer.self_attn.head_dim
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, get_rope_parameters(config))

    def forward(self, input_embeds: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, S, H] each -> predicted features [B, S, H] (causal, positions 0..S-1)."""
        batch, seq, _ = input_embeds.shape
        positions = torch.arange(seq).repeat(batch)
        cos, sin = self.rotary_emb(positions)
        x = self.fc(torch.cat([input_embeds, hidden_states], dim=-1))
        for layer in self.layers:
            x = layer(x, cos, sin)
        return x


def eagle_config(target_config: dict[str, Any]) -> dict[str, Any]:
    config = dict(target_config)
    config["num_hidden_layers"] = 1
    config["architectures"] = ["LlamaForCausalLM"]
    config["bias"] = False
    return config


def save_eagle_head(
    head: TrainableEagleHead, config: dict[str, Any], out_dir: Path, dtype: torch.dtype = torch.float32
) -> None:
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to(dtype).contiguous() for k, v in head.state_dict().items() if "rotary_emb" not in k}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def save_random_eagle_head(target_dir: str | Path, out_dir: str | Path, seed: int = 0) -> Path:
    """A random-weight head for `target_dir` (tests)."""
    from transformers import LlamaConfig

    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    config = eagle_config(target_config)
    torch.manual_seed(seed)
    head = TrainableEagleHead(LlamaConfig(**config))
    save_eagle_head(head, config, Path(out_dir))
    return Path(out_dir)


def _target_features(model: Any, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states (after the norm) and logits of the HF target."""
    with torch.no_grad():
        out = model.model(input_ids=windows)
        hidden = out.last_hidden_state
        return hidden, model.lm_head(hidden)


def _train_tokens(max_files: int | None) -> list[int]:
    """The tiny corpus' train split as one token list (BOS before each file)."""
    from pagedllm.model_registry.tiny import get_tokenizer_dir
    from pagedllm.model_registry.tiny.corpus import load_split
    from pagedllm.model_registry.tiny.tokenizer import BOS_TOKEN, source_encoder

    tokenizer = source_encoder(get_tokenizer_dir())
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    if bos_id is None:
        raise ValueError(f"the shipped tokenizer has no {BOS_TOKEN!r} token")
    files = load_split("train")
    if max_files is not None:
        files = files[:: max(1, len(files) // max_files)][:max_files]
    ids: list[int] = []
    for encoding in tokenizer.encode_batch([f.text for f in files], add_special_tokens=False):
        ids.append(bos_id)
        ids.extend(encoding.ids)
    return ids


def train(
    target: str, out_dir: Path, *, minutes: float, seq_len: int, batch_size: int, lr: float, seed: int,
    max_files: int | None = None,
) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pagedllm.model_registry.tiny import resolve_model_path

    target_dir = Path(resolve_model_path(target))
    target_config = json.loads((target_dir / "config.json").read_text())
    config = eagle_config(target_config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    embed = model.get_input_embeddings()
    head = TrainableEagleHead(LlamaConfig(**config))
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)

    tokens = torch.tensor(_train_tokens(max_files), dtype=torch.long)
    num_windows = (len(tokens) - 1) // seq_len
    print(f"train tokens: {len(tokens):,}; windows of {seq_len}: {num_windows:,}", flush=True)
    generator = torch.Generator().manual_seed(seed)
    started = time.time()
    deadline = started + minutes * 60
    step = 0
    while time.time() < deadline:
        # Linear decay to a tenth of lr over the time budget.
        for group in optimizer.param_groups:
            group["lr"] = lr * (1.0 - 0.9 * (time.time() - started) / (deadline - started))
        starts = torch.randint(0, len(tokens) - seq_len - 1, (batch_size,), generator=generator)
        windows = torch.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()])  # [B, S + 1]
        hidden, logits = _target_features(model, windows[:, :-1])  # features at positions 0..S-1
        # Row t reads (token_{t+1}, h_t) and predicts h_{t+1} (and token_{t+2}).
        with torch.no_grad():
            input_embeds = embed(windows[:, 1:-1])  # tokens 1..S-1
            # EAGLE's feature noise (uniform, +-0.1 in the paper's setting of
            # unnormalized features; scaled to the feature size here).
            noisy = hidden[:, :-1] + (torch.rand_like(hidden[:, :-1]) - 0.5) * 0.2 * hidden.std()
        predicted = head(input_embeds, noisy)
        target_hidden = hidden[:, 1:]
        regression = F.smooth_l1_loss(predicted, target_hidden)
        predicted_logits = model.lm_head(predicted)
        target_probs = logits[:, 1:].softmax(dim=-1)
        classification = -(target_probs * predicted_logits.log_softmax(dim=-1)).sum(-1).mean()
        loss = regression + 0.1 * classification
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
        optimizer.step()
        if step % 25 == 0:
            with torch.no_grad():
                accuracy = (predicted_logits.argmax(-1) == logits[:, 1:].argmax(-1)).float().mean().item()
            print(
                f"step {step} loss {loss.item():.4f} (feature {regression.item():.4f}, "
                f"ce {classification.item():.3f}) top1-agree {accuracy:.3f}",
                flush=True,
            )
        step += 1
    # Half precision like the rest of the shipped family.
    save_eagle_head(head, dict(config, torch_dtype="float16"), out_dir, dtype=torch.float16)
    command = "python -m pagedllm.training.train_eagle " + " ".join(sys.argv[1:])
    (out_dir / "README.md").write_text(
        f"# pagedllm-tiny-eagle\n\nAn EAGLE-1 head for `{target_dir.name}`, trained by "
        f"`{command}` ({step} steps of {batch_size} x {seq_len} tokens in {minutes:g} minutes, "
        f"{torch.get_num_threads()} torch thread(s), lr {lr}, seed {seed}) on the target's hidden states over "
        "the train split of the tiny corpus.\n"
    )
    print(f"saved {out_dir} after {step} steps", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="tiny")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--minutes", type=float, default=12.0)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-files", type=int, default=None, help="train on a sample of the split's files")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    train(args.target, args.out, minutes=args.minutes, seq_len=args.seq_len, batch_size=args.batch_size,
          lr=args.lr, seed=args.seed, max_files=args.max_files)


if __name__ == "__main__":
    main()
