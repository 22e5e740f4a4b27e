"""HF checkpoint loading: single and sharded safetensors, strict name check, tied embeddings."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import build_tiny_model, cached_tiny_model
from safetensors.torch import load_file, save_file

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.core.errors import PagedLLMError
from pagedllm.model_registry.loader import (
    ModelLoadError,
    get_architecture,
    iterate_safetensors,
    load_hf_config,
    load_model,
)
from pagedllm.model_registry.models.llama import LlamaForCausalLM
from pagedllm.model_registry.models.qwen2 import Qwen2ForCausalLM


def load(path: Path, model_cls: type = LlamaForCausalLM, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    return load_model(path, model_cls=model_cls, attn_backend=TorchNativeBackend, dtype=dtype, device="cpu")


def rewrite_checkpoint(src: Path, dst: Path, edit) -> Path:  # type: ignore[no-untyped-def]
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_stacked_weights_are_filled_from_their_checkpoint_shards() -> None:
    path = cached_tiny_model("qwen2")
    model = load(path, Qwen2ForCausalLM)
    file = load_file(str(path / "model.safetensors"))
    attn = model.model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([64, 32, 32])
    assert torch.equal(q, file["model.layers.1.self_attn.q_proj.weight"])
    assert torch.equal(k, file["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(v, file["model.layers.1.self_attn.v_proj.weight"])
    assert torch.equal(attn.qkv_proj.bias[64:96], file["model.layers.1.self_attn.k_proj.bias"])
    gate, up = model.model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(gate, file["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(up, file["model.layers.0.mlp.up_proj.weight"])


def test_sharded_checkpoint_loads_the_same_weights(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    single = cached_tiny_model("llama")
    hf = AutoModelForCausalLM.from_pretrained(str(single), local_files_only=True)
    hf.save_pretrained(str(tmp_path), safe_serialization=True, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1

    names = [name for name, _ in iterate_safetensors(tmp_path)]
    assert sorted(names) == sorted(load_file(str(single / "model.safetensors")))
    sharded_state = load(tmp_path).state_dict()
    for name, tensor in load(single).state_dict().items():
        assert torch.equal(tensor, sharded_state[name]), name


def test_missing_weights_are_all_named(tmp_path: Path) -> None:
    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.1.self_attn.k_proj.weight"]
        del tensors["model.norm.weight"]

    path = rewrite_checkpoint(cached_tiny_model("llama"), tmp_path / "m", drop)
    with pytest.raises(ModelLoadError) as info:
        load(path)
    assert info.value.missing == ["model.layers.1.self_attn.k_proj.weight", "model.norm.weight"]
    assert info.value.unexpected == []
    assert "model.norm.weight" in str(info.value) and isinstance(info.value, PagedLLMError)


def test_unexpected_weights_are_all_named(tmp_path: Path) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.rope_bias"] = torch.zeros(3)
        tensors["vision_tower.proj.weight"] = torch.zeros(2, 2)
        del tensors["model.embed_tokens.weight"]

    path = rewrite_checkpoint(cached_tiny_model("llama"), tmp_path / "m", add)
    with pytest.raises(ModelLoadError) as info:
        load(path)
    assert info.value.unexpected == ["model.layers.0.self_attn.rope_bias", "vision_tower.proj.weight"]
    assert info.value.missing == ["model.embed_tokens.weight"]


def test_misshaped_weight_is_a_load_error(tmp_path: Path) -> None:
    def shrink(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.v_proj.weight"] = torch.zeros(16, 64)

    path = rewrite_checkpoint(cached_tiny_model("llama"), tmp_path / "m", shrink)
    with pytest.raises(ModelLoadError, match=r"\(16, 64\)"):
        load(path)


def test_tied_lm_head_in_the_file_is_ignored(tmp_path: Path) -> None:
    src = cached_tiny_model("llama", tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(str(src / "model.safetensors"))

    def add_lm_head(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = torch.full_like(tensors["model.embed_tokens.weight"], 7.0)

    model = load(rewrite_checkpoint(src, tmp_path / "m", add_lm_head))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not torch.equal(model.lm_head.weight, torch.full_like(model.lm_head.weight, 7.0))


def test_untied_model_requires_lm_head(tmp_path: Path) -> None:
    path = rewrite_checkpoint(cached_tiny_model("llama"), tmp_path / "m", lambda t: t.pop("lm_head.weight"))
    with pytest.raises(ModelLoadError) as info:
        load(path)
    assert info.value.missing == ["lm_head.weight"]


def test_checkpoint_quantization_the_model_cannot_read_is_refused_by_name(tmp_path: Path) -> None:
    """A config.json quantization_config names the format of the weights;
    a model that does not list its quant_method, and that no registered
    quantization method reads (HQQ), refuses the checkpoint
    before reading a weight, at load_model and when the engine plans its
    ranks (float-named tensors would otherwise load as if they were float).
    Dummy weights read no file, so they build as float."""
    import json

    from pagedllm import LLM

    path = tmp_path / "llama-hqq"
    shutil.copytree(cached_tiny_model("llama"), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "HQQ"}}))
    message = r"quant_method='hqq' is not supported by LlamaForCausalLM; supported: none, float checkpoints only"
    with pytest.raises(ModelLoadError, match=message):
        load(path)
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=str(path), dtype="float32", num_kv_blocks=16)
    load_model(path, model_cls=LlamaForCausalLM, attn_backend=TorchNativeBackend, dtype=torch.float32,
               device="cpu", load_format="dummy")


def test_model_is_built_in_the_requested_dtype() -> None:
    model = load(cached_tiny_model("llama"), dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training


def test_architecture_from_config_or_override(tmp_path: Path) -> None:
    config = load_hf_config(cached_tiny_model("qwen2"))
    assert get_architecture(config) == "Qwen2ForCausalLM"
    assert get_architecture(config, override="MyQwen") == "MyQwen"
    config.architectures = None
    with pytest.raises(ModelLoadError, match="architecture"):
        get_architecture(config)


def test_folder_without_config_or_weights(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        load_hf_config(tmp_path)
    with pytest.raises(ModelLoadError, match=r"model\.safetensors"):
        list(iterate_safetensors(tmp_path))


def test_build_tiny_model_defaults(tmp_path: Path) -> None:
    path = build_tiny_model("qwen3", tmp_path / "q", seed=3, num_hidden_layers=1)
    config = load_hf_config(path)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (
        512, 64, 1, 2
    )
    assert config.architectures == ["Qwen3ForCausalLM"]
    # Same seed, same weights.
    again = build_tiny_model("qwen3", tmp_path / "q2", seed=3, num_hidden_layers=1)
    first, second = load_file(str(path / "model.safetensors")), load_file(str(again / "model.safetensors"))
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_build_tiny_model_with_tokenizer_takes_its_vocabulary(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    path = build_tiny_model("llama", tmp_path / "t", with_tokenizer=True, num_hidden_layers=1)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    config = load_hf_config(path)
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.eos_token_id
    assert load(path).lm_head.weight.shape == (len(tokenizer), 64)
