"""GPT-2 through this package's entry point: a tiny random GPT-2 saved by
transformers loads in pagedllm, and greedy tokens equal transformers'."""

from __future__ import annotations

import importlib.metadata
import shutil
from pathlib import Path

import torch

from pagedllm import LLM, SamplingParams
from pagedllm.model_registry.tiny import get_tokenizer_dir
from pagedllm.plugins import PluginManager
from pagedllm.testing.checkpoints import hf_greedy


def save_tiny_gpt2(path: Path) -> Path:
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer_dir = Path(get_tokenizer_dir())
    for item in tokenizer_dir.iterdir():
        if item.is_file():
            shutil.copy(item, path / item.name)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=128, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(str(path))
    return path


def test_gpt2_is_registered_through_the_entry_point() -> None:
    pm = PluginManager()
    pm.load(strict=True)
    registration = pm.registry("model").get("GPT2LMHeadModel")
    assert registration.source == f"pagedllm-example-model {importlib.metadata.version('pagedllm-example-model')}"


def test_gpt2_greedy_tokens_equal_transformers(tmp_path: Path) -> None:
    path = save_tiny_gpt2(tmp_path)
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=64)
    prompt = "def fibonacci(n):"
    prompt_ids = llm.get_tokenizer().encode(prompt)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    output = llm.generate([prompt], params, use_tqdm=False)[0]
    assert output.outputs[0].token_ids == hf_greedy(path, prompt_ids, 8)
