"""PEFT adapters as lora/adapter.py loads them: the tensors and their
scaling, the content digest, and one clear error per adapter that cannot be served."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.lora_adapters import write_peft_adapter
from safetensors.torch import load_file, save_file

from pagedllm.core.errors import InvalidRequestError
from pagedllm.lora.adapter import LoRAAdapterError, base_model_modules, load_lora_adapter
from pagedllm.lora.request import LoRARequest
from pagedllm.testing.checkpoints import config_json, save_random_checkpoint

RANK = 4
TARGETS = ["q_proj", "v_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_random_checkpoint(config_json("LlamaForCausalLM"), tmp_path_factory.mktemp("lora") / "base")


@pytest.fixture(scope="module")
def adapter(base: Path) -> Path:
    return write_peft_adapter(base, base.parent / "adapter", rank=RANK, alpha=8, target_modules=TARGETS, seed=1)


def load(path: Path, base: Path | None = None, **limits: int) -> object:
    return load_lora_adapter(path, name="test", max_rank=limits.get("max_rank", 16),
                             max_bytes=limits.get("max_bytes", 1 << 30),
                             base_modules=None if base is None else base_model_modules(base))


def copy_adapter(adapter: Path, to: Path, config: dict[str, object] | None = None) -> Path:
    shutil.copytree(adapter, to)
    if config is not None:
        raw = json.loads((to / "adapter_config.json").read_text())
        (to / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    return to


def test_tensors_per_base_module_with_scaling_folded_into_b(base: Path, adapter: Path) -> None:
    loaded = load_lora_adapter(adapter, name="sql", max_rank=16, max_bytes=1 << 30,
                               base_modules=base_model_modules(base))
    raw = load_file(adapter / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.1.self_attn.q_proj"
    assert torch.equal(loaded.weights["model.layers.1.self_attn.q_proj.lora_A"], raw[f"{prefix}.lora_A.weight"])
    assert torch.equal(loaded.weights["model.layers.1.self_attn.q_proj.lora_B"], raw[f"{prefix}.lora_B.weight"] * 2.0)
    assert loaded.config.target_modules == tuple(sorted(
        f"model.layers.{layer}.{part}.{name}" for layer in (0, 1)
        for part, name in (("self_attn", "q_proj"), ("self_attn", "v_proj"), ("mlp", "down_proj"))))
    assert loaded.config.rank == RANK and loaded.ref.name == "sql" and loaded.ref.path == str(adapter.resolve())
    assert len(loaded.weights) == 2 * 6


def test_rslora_scales_by_the_square_root_of_the_rank(adapter: Path, tmp_path: Path) -> None:
    plain, rs = load(adapter), load(copy_adapter(adapter, tmp_path / "rs", {"use_rslora": True}))
    key = "model.layers.0.mlp.down_proj.lora_B"
    # alpha / sqrt(r) = 8 / 2 against alpha / r = 8 / 4
    assert torch.allclose(rs.weights[key], plain.weights[key] * 2.0)
    assert rs.ref.digest != plain.ref.digest


def test_digest_is_the_content_not_the_name_path_or_metadata(adapter: Path, tmp_path: Path) -> None:
    first = load(adapter)
    moved = load_lora_adapter(copy_adapter(adapter, tmp_path / "moved", {"base_model_name_or_path": "elsewhere"}),
                              name="another-name", max_rank=16, max_bytes=1 << 30)
    assert moved.ref.digest == first.ref.digest
    retrained = copy_adapter(adapter, tmp_path / "retrained")
    tensors = load_file(retrained / "adapter_model.safetensors")
    key = next(iter(tensors))
    tensors[key] = tensors[key].clone()
    tensors[key][0, 0] += 1e-3
    save_file(tensors, retrained / "adapter_model.safetensors")
    assert load(retrained).ref.digest != first.ref.digest
    assert load(copy_adapter(adapter, tmp_path / "alpha", {"lora_alpha": 9})).ref.digest != first.ref.digest


def test_base_model_modules_are_the_checkpoints_linear_shapes(base: Path) -> None:
    modules = base_model_modules(base)
    assert modules is not None
    assert modules["model.layers.0.self_attn.q_proj"] == (64, 64)
    assert modules["model.layers.0.self_attn.k_proj"] == (32, 64)
    assert modules["model.layers.1.mlp.down_proj"] == (64, 128)


def edit_tensors(adapter: Path, to: Path, edit: object) -> Path:
    copy_adapter(adapter, to)
    tensors = load_file(to / "adapter_model.safetensors")
    edit(tensors)  # type: ignore[operator]
    save_file(tensors, to / "adapter_model.safetensors")
    return to


def test_each_adapter_that_cannot_be_served_is_a_clear_error(base: Path, adapter: Path, tmp_path: Path) -> None:
    cases: list[tuple[Path, dict[str, int], str, str]] = []
    cases.append((tmp_path / "missing", {}, "lora_path", "a folder holding adapter_config.json"))
    pickled = copy_adapter(adapter, tmp_path / "pickled")
    (pickled / "adapter_model.safetensors").rename(pickled / "adapter_model.bin")
    cases.append((pickled, {}, "lora_path", "adapter_model.bin: pickled weights are never loaded"))
    cases.append((adapter, {"max_bytes": 1000}, "lora_path", "at most 1000"))
    cases.append((adapter, {"max_rank": 2}, "r", "at most max_lora_rank=2"))
    cases.append((copy_adapter(adapter, tmp_path / "dora", {"use_dora": True}), {}, "use_dora", "DoRA"))
    cases.append((copy_adapter(adapter, tmp_path / "bias", {"bias": "all"}), {}, "bias", "LoRA biases"))
    bad_json = copy_adapter(adapter, tmp_path / "bad_json")
    (bad_json / "adapter_config.json").write_text("{not json")
    cases.append((bad_json, {}, "adapter_config.json", "valid JSON"))

    def add_module(tensors: dict[str, torch.Tensor]) -> None:
        tensors["base_model.model.model.layers.0.self_attn.rotary.lora_A.weight"] = torch.zeros(RANK, 64)
        tensors["base_model.model.model.layers.0.self_attn.rotary.lora_B.weight"] = torch.zeros(64, RANK)

    cases.append((edit_tensors(adapter, tmp_path / "lacks", add_module), {}, "target_modules", "has no such module"))

    def widen(tensors: dict[str, torch.Tensor]) -> None:
        key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
        tensors[key] = torch.zeros(RANK, 96)

    cases.append((edit_tensors(adapter, tmp_path / "other_base", widen), {}, "weights", "trained for another base"))

    def embedding(tensors: dict[str, torch.Tensor]) -> None:
        tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = torch.zeros(RANK, 10)

    cases.append((edit_tensors(adapter, tmp_path / "embedding", embedding), {}, "weights", "linear layers"))
    for path, limits, field, message in cases:
        with pytest.raises(LoRAAdapterError) as info:
            load(path, base, **limits)
        assert info.value.field == field, (path, info.value)
        assert message in str(info.value), (path, info.value)
        assert isinstance(info.value, InvalidRequestError)


def test_lora_request_fields_are_checked() -> None:
    request = LoRARequest("sql", 1, "/adapters/sql")
    assert (request.lora_name, request.lora_int_id, request.lora_path, request.base_model_name) == (
        "sql", 1, "/adapters/sql", None)
    with pytest.raises(InvalidRequestError, match="lora_int_id"):
        LoRARequest("sql", 0, "/adapters/sql")
    with pytest.raises(InvalidRequestError, match="lora_name"):
        LoRARequest("", 1, "/adapters/sql")
