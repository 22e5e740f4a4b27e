"""Random PEFT LoRA adapters for test checkpoints, and transformers + PEFT
greedy tokens as the reference (float32)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def _base_model(model_dir: Path) -> torch.nn.Module:
    import transformers

    config = json.loads((Path(model_dir) / "config.json").read_text())
    model_cls = getattr(transformers, config["architectures"][0])
    return model_cls.from_pretrained(str(model_dir), dtype=torch.float32).eval()


def write_peft_adapter(
    model_dir: Path,
    out_dir: Path,
    *,
    rank: int,
    target_modules: Sequence[str],
    alpha: float = 16,
    seed: int = 0,
    use_rslora: bool = False,
    scale: float = 0.5,
) -> Path:
    """A PEFT adapter of `rank` on `target_modules` with random A and B
    (B non-zero, so it changes the output), saved in PEFT's format."""
    from peft import LoraConfig, get_peft_model

    model = _base_model(model_dir)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), lora_dropout=0.0,
                        use_rslora=use_rslora, init_lora_weights=False)
    peft_model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in peft_model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale / parameter.shape[-1] ** 0.5)
    peft_model.save_pretrained(str(out_dir))
    return Path(out_dir)


def peft_greedy(
    model_dir: Path, adapter_dir: Path | None, prompts: Sequence[Sequence[int]], max_new_tokens: int
) -> list[list[int]]:
    """Greedy continuations by transformers with the PEFT adapter applied
    (None: the base model), float32, one prompt at a time."""
    model = _base_model(model_dir)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([list(prompt)])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
