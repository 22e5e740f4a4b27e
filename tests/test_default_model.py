"""The shipped BPE tokenizer and chat template, and the random-weight
benchmark model built once into the cache (the shipped models themselves are
tested in test_tiny_models.py)."""

from __future__ import annotations

import inspect
import json
import textwrap

import pytest

from pagedllm.model_registry import tiny
from pagedllm.model_registry.tiny import cache as tiny_cache
from pagedllm.model_registry.tiny import tokenizer as tiny_tokenizer
from pagedllm.training.tiny import tokenizer as training_tokenizer


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A private cache for this module, so building is exercised from scratch."""
    path = tmp_path_factory.mktemp("pagedllm-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PAGEDLLM_CACHE_DIR", str(path))
        yield path


@pytest.fixture(scope="module")
def model_dir(cache_dir):
    return tiny.get_benchmark_model_dir()


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny.get_tokenizer_dir())


def test_tokenizer_has_8192_tokens_and_the_special_tokens(hf_tokenizer):
    assert len(hf_tokenizer) == 8192
    ids = {token: hf_tokenizer.convert_tokens_to_ids(token) for token in tiny_tokenizer.SPECIAL_TOKENS}
    assert ids == {"<|bos|>": 0, "<|eos|>": 1, "<|pad|>": 2, "<|im_start|>": 3, "<|im_end|>": 4}
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (0, 1, 2)
    # The chat markers are single tokens, not spelled out.
    assert hf_tokenizer.encode("<|im_start|>user") == [3, *hf_tokenizer.encode("user")]


def test_tokenizer_round_trips_python_source_and_non_ascii_text(hf_tokenizer):
    samples = [
        inspect.getsource(textwrap),
        "naïve café — 日本語のテキスト, 한국어, emoji 🐍🚀 and \t tabs\r\n  trailing  ",
        "",
    ]
    for text in samples:
        ids = hf_tokenizer.encode(text)
        assert hf_tokenizer.decode(ids) == text
    # No BOS is added: the encoding is exactly the text's tokens.
    assert hf_tokenizer.encode("x") == [hf_tokenizer.convert_tokens_to_ids("x")]
    # Trained on Python: common keywords are single tokens.
    assert len(hf_tokenizer.encode("def")) == 1 and len(hf_tokenizer.encode(" return")) == 1


def test_chat_template_renders_chatml(hf_tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    rendered = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    without_prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False)
    assert without_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"


def test_benchmark_model_loads_with_transformers(model_dir, hf_tokenizer):
    import torch
    from transformers import AutoModelForCausalLM

    from pagedllm.model_registry.tiny.benchmark_model import random_llama_weights

    config = json.loads((model_dir / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    hf_config = model.config
    assert (hf_config.hidden_size, hf_config.intermediate_size, hf_config.num_hidden_layers) == (256, 688, 4)
    assert (hf_config.num_attention_heads, hf_config.num_key_value_heads, hf_config.vocab_size) == (4, 2, 8192)
    assert hf_config.max_position_embeddings == 2048 and not hf_config.tie_word_embeddings
    assert (hf_config.bos_token_id, hf_config.eos_token_id) == (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id)
    assert model.dtype == torch.float32
    # Weights are exactly the seeded ones, under HF's names.
    expected = random_llama_weights(config)
    state = model.state_dict()
    assert set(state) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0)
    assert 0.015 < expected["lm_head.weight"].std().item() < 0.025
    logits = model(torch.tensor([hf_tokenizer.encode("def f():")])).logits
    assert logits.shape == (1, len(hf_tokenizer.encode("def f():")), 8192)


def test_second_call_reuses_the_cache(model_dir, cache_dir, monkeypatch):
    files = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    assert set(files) >= {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                          "special_tokens_map.json"}

    def must_not_build(*args, **kwargs):
        raise AssertionError("rebuilt a cached artifact")

    monkeypatch.setattr(training_tokenizer, "train_tokenizer", must_not_build)
    monkeypatch.setattr("pagedllm.model_registry.tiny.benchmark_model.build_benchmark_model", must_not_build)
    assert tiny.get_benchmark_model_dir() == model_dir == cache_dir / tiny.BENCHMARK_MODEL_CACHE_NAME
    # The tokenizer and the default model are shipped: nothing is trained at run time.
    assert (tiny.get_tokenizer_dir() / "tokenizer.json").is_file()
    assert (tiny.get_default_model_dir() / "model.safetensors").is_file()
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == files
    # No temporary build folders are left behind.
    assert sorted(p.name for p in cache_dir.iterdir()) == [tiny.BENCHMARK_MODEL_CACHE_NAME]


def test_shipped_tokenizer_is_what_the_training_code_builds(tmp_path):
    training_tokenizer.train_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_bytes() == (tiny.get_tokenizer_dir() / name).read_bytes()


def test_concurrent_builder_that_wins_the_race_is_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))

    def build_while_another_process_finishes(out_dir):
        (out_dir / "mine.txt").write_text("loser")
        winner = tmp_path / "artifact"
        winner.mkdir()
        (winner / "theirs.txt").write_text("winner")

    path = tiny_cache.build_once("artifact", build_while_another_process_finishes)
    assert path == tmp_path / "artifact"
    assert [p.name for p in path.iterdir()] == ["theirs.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["artifact"]


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))

    def broken(out_dir):
        (out_dir / "half.txt").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        tiny_cache.build_once("artifact", broken)
    assert list(tmp_path.iterdir()) == []
