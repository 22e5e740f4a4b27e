"""`load_format` (vLLM's names): which weight files a model is read from, or
none (`dummy`); and a bad value is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.tiny_models import cached_tiny_model
from safetensors.torch import load_file

from pagedllm.attention_backends.torch_native import TorchNativeBackend
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import ConfigError
from pagedllm.core.sampling_params import SamplingParams
from pagedllm.engine.llm import LLM
from pagedllm.model_registry.loader import DUMMY_WEIGHT_RANGE, ModelLoadError, load_model
from pagedllm.model_registry.models.llama import LlamaForCausalLM


def load(path: Path, load_format: str, seed: int = 0) -> LlamaForCausalLM:
    return load_model(
        path, model_cls=LlamaForCausalLM, attn_backend=TorchNativeBackend, dtype=torch.float32, device="cpu",
        load_format=load_format, seed=seed,
    )


def parameters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def folder_without_weights(tmp_path: Path, with_tokenizer: bool = False) -> Path:
    """The tiny llama's folder (config, tokenizer) with no weight file."""
    source = cached_tiny_model("llama", with_tokenizer=with_tokenizer)
    folder = tmp_path / "no-weights"
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.safetensors.index.json"))
    return folder


def folder_with_pt_weights(tmp_path: Path, shards: int = 1) -> Path:
    """The tiny llama's checkpoint saved as PyTorch .bin (one file, or shards
    listed in pytorch_model.bin.index.json), without its safetensors."""
    source = cached_tiny_model("llama")
    folder = folder_without_weights(tmp_path)
    tensors = load_file(str(source / "model.safetensors"))
    if shards == 1:
        torch.save(tensors, folder / "pytorch_model.bin")
        return folder
    names = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        file_name = f"pytorch_model-{shard + 1:05d}-of-{shards:05d}.bin"
        part = {name: tensors[name] for name in names[shard::shards]}
        torch.save(part, folder / file_name)
        weight_map.update(dict.fromkeys(part, file_name))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.mark.parametrize("shards", [1, 3])
def test_pt_weights_equal_the_checkpoint_tensors(tmp_path: Path, shards: int) -> None:
    reference = parameters(load(cached_tiny_model("llama"), "safetensors"))
    folder = folder_with_pt_weights(tmp_path, shards)
    for load_format in ("pt", "auto"):  # auto: no safetensors here, so .bin
        loaded = parameters(load(folder, load_format))
        assert loaded.keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(loaded[name], tensor), (load_format, name)


def test_safetensors_weights_equal_the_checkpoint_tensors() -> None:
    path = cached_tiny_model("llama")
    file = load_file(str(path / "model.safetensors"))
    model = load(path, "safetensors")
    layer = model.model.layers[1]
    assert torch.equal(model.model.embed_tokens.weight, file["model.embed_tokens.weight"])
    assert torch.equal(layer.self_attn.o_proj.weight, file["model.layers.1.self_attn.o_proj.weight"])
    assert torch.equal(layer.mlp.down_proj.weight, file["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.model.norm.weight, file["model.norm.weight"])


def test_auto_prefers_safetensors_when_both_formats_are_there(tmp_path: Path) -> None:
    folder = folder_with_pt_weights(tmp_path)
    tensors = load_file(str(cached_tiny_model("llama") / "model.safetensors"))
    # The .bin copy differs, so which file was read shows in the values.
    torch.save({name: tensor + 1 for name, tensor in tensors.items()}, folder / "pytorch_model.bin")
    shutil.copy(cached_tiny_model("llama") / "model.safetensors", folder / "model.safetensors")
    norm = "model.norm.weight"
    assert torch.equal(parameters(load(folder, "auto"))[norm], tensors[norm])
    assert torch.equal(parameters(load(folder, "pt"))[norm], tensors[norm] + 1)


def test_each_format_names_the_files_it_did_not_find(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"neither pytorch_model\.bin nor pytorch_model\.bin\.index\.json"):
        load(cached_tiny_model("llama"), "pt")
    with pytest.raises(ModelLoadError, match=r"neither model\.safetensors nor model\.safetensors\.index\.json"):
        load(folder_with_pt_weights(tmp_path), "safetensors")


def test_a_pt_file_holding_code_is_refused(tmp_path: Path) -> None:
    folder = folder_without_weights(tmp_path)
    torch.save({"model.norm.weight": torch.ones(1), "hook": print}, folder / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"pytorch_model\.bin is not a readable PyTorch weights file"):
        load(folder, "pt")


def test_dummy_weights_have_the_checkpoint_shapes_and_read_no_weight_file(tmp_path: Path) -> None:
    reference = parameters(load(cached_tiny_model("llama"), "safetensors"))
    dummy = parameters(load(folder_without_weights(tmp_path), "dummy"))
    assert {name: tuple(t.shape) for name, t in dummy.items()} == {
        name: tuple(t.shape) for name, t in reference.items()
    }
    for name, tensor in dummy.items():
        assert tensor.dtype == torch.float32
        assert tensor.abs().max().item() <= DUMMY_WEIGHT_RANGE, name
        assert not torch.equal(tensor, reference[name]), name


def test_dummy_weights_follow_the_seed(tmp_path: Path) -> None:
    folder = folder_without_weights(tmp_path)
    first, again, other = (parameters(load(folder, "dummy", seed)) for seed in (0, 0, 1))
    name = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(first[name], again[name])
    assert not torch.equal(first[name], other[name])


def test_a_dummy_model_runs_engine_steps(tmp_path: Path) -> None:
    folder = folder_without_weights(tmp_path, with_tokenizer=True)
    llm = LLM(str(folder), load_format="dummy", dtype="float32", num_kv_blocks=16)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    output = llm.generate(["hello there"], params, use_tqdm=False)[0].outputs[0]
    assert len(output.token_ids) == 5
    assert all(0 <= token < llm.engine_core.ready.vocab_size for token in output.token_ids)


def test_an_unknown_load_format_is_refused_with_the_allowed_ones() -> None:
    with pytest.raises(ConfigError) as caught:
        EngineConfig.from_flat(load_format="npcache")
    assert caught.value.key == "model.load_format"
    assert caught.value.value == "npcache"
    assert caught.value.allowed == "'auto', 'safetensors', 'pt', 'gguf', 'dummy'"


def test_load_format_comes_from_the_flag_the_env_and_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from pagedllm.entrypoints.cli import build_parser, serve_config

    args = build_parser().parse_args(["serve", "tiny", "--load-format", "dummy"])
    assert serve_config(args).model.load_format == "dummy"
    config_file = tmp_path / "engine.yaml"
    config_file.write_text("model:\n  load_format: safetensors\n")
    assert EngineConfig.load(config_file).model.load_format == "safetensors"
    monkeypatch.setenv("PAGEDLLM_MODEL__LOAD_FORMAT", "pt")
    assert EngineConfig.load(config_file).model.load_format == "pt"
    assert EngineConfig().model.load_format == "pt"
