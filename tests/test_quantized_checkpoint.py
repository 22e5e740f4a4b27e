"""The seam for quantized checkpoints (plugin API 1.14): a method registered
with `checkpoint_formats` serves a checkpoint whose config.json names that
format; its `create_weights` gives each layer the checkpoint's storage before
loading, the strict loader maps the stored names through the stacked layers,
and `quantize_linear` turns them into the kernel's storage.

A toy format written here, `rowint8` (each linear's weight as int8 `weight_q`
[out, in] and a float32 row scale `weight_s` [out]), stands for the real ones:
its greedy tokens must equal transformers' on the dequantized weights."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from helpers.tiny_models import cached_tiny_model
from helpers.validation import greedy_token_ids
from safetensors.torch import load_file, save_file
from torch import nn

from pagedllm import LLM
from pagedllm.core.errors import ConfigError
from pagedllm.plugins import RegisterFn, get_plugin_manager, hookimpl
from pagedllm.quantization.base import QuantizationMethod

FORMAT = "rowint8"
LINEAR_SUFFIXES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PROMPTS = [[1, 5, 9, 14], [3, 3, 8]]


class RowInt8Method(QuantizationMethod):
    """Reads `rowint8` checkpoints; records what it was built with and offered."""

    built_with: ClassVar[dict[str, object] | None] = None
    created: ClassVar[list[str]] = []
    modules: ClassVar[dict[str, list[str]]] = {}  # layer -> the checkpoint modules it holds

    @classmethod
    def from_checkpoint_config(cls, quant_config: dict[str, object]) -> QuantizationMethod:
        RowInt8Method.built_with = quant_config
        return cls()

    def create_weights(self, layer: nn.Linear, prefix: str) -> bool:
        out_features, in_features = layer.weight.shape
        loader = layer.weight_loader  # type: ignore[attr-defined]
        del layer.weight
        layer.weight_q = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.int8), requires_grad=False)
        layer.weight_s = nn.Parameter(torch.empty(out_features, dtype=torch.float32), requires_grad=False)
        for param in (layer.weight_q, layer.weight_s):
            param.weight_loader = loader  # type: ignore[attr-defined]  # [out, in] / [out]: the layer's own slicing
        RowInt8Method.created.append(prefix)
        RowInt8Method.modules[prefix] = self.checkpoint_modules(prefix)
        return True

    def quantize_linear(self, layer: nn.Linear, prefix: str) -> bool:
        q, s = layer.weight_q, layer.weight_s
        del layer.weight_q, layer.weight_s
        dtype = layer.bias.dtype if layer.bias is not None else torch.get_default_dtype()
        layer.weight = nn.Parameter((q.float() * s[:, None]).to(dtype), requires_grad=False)
        return True


class RowInt8Plugin:
    @hookimpl
    def register_quantization_methods(self, register: RegisterFn) -> None:
        register(FORMAT, RowInt8Method, checkpoint_formats=[FORMAT], quantizes_float=False)


@pytest.fixture
def rowint8_plugin() -> Iterator[None]:
    pm = get_plugin_manager()
    pm.register(RowInt8Plugin(), name="test-rowint8")
    RowInt8Method.built_with, RowInt8Method.created, RowInt8Method.modules = None, [], {}
    yield
    pm.unregister(name="test-rowint8")


def _write_rowint8(tmp_path: Path) -> tuple[Path, Path]:
    """(the rowint8 checkpoint, a float checkpoint of its dequantized weights)."""
    source = cached_tiny_model("llama", with_tokenizer=True)
    quantized, dequantized = tmp_path / "rowint8", tmp_path / "dequantized"
    shutil.copytree(source, quantized)
    shutil.copytree(source, dequantized)
    tensors = load_file(str(source / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        module = name.rsplit(".", 2)
        if name.endswith(".weight") and module[-2] in LINEAR_SUFFIXES:
            scale = tensor.float().abs().amax(dim=1) / 127
            q = torch.round(tensor.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
            stored[name.removesuffix("weight") + "weight_q"] = q
            stored[name.removesuffix("weight") + "weight_s"] = scale
            tensors[name] = (q.float() * scale[:, None]).to(tensor.dtype)
        else:
            stored[name] = tensor
    save_file(stored, str(quantized / "model.safetensors"))
    save_file(tensors, str(dequantized / "model.safetensors"))
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"] = {"quant_method": FORMAT, "bits": 8}
    (quantized / "config.json").write_text(json.dumps(config))
    return quantized, dequantized


def _greedy(path: Path, **kwargs: Any) -> list[list[int]]:
    return greedy_token_ids(path, PROMPTS, 8, **kwargs)


def test_a_checkpoint_in_a_registered_format_loads_through_its_method(
    rowint8_plugin: None, tmp_path: Path
) -> None:
    """No model.quantization: the method is chosen from config.json, built with
    its quantization_config, offered every linear layer but the LM head before
    loading, and the stacked q/k/v and gate/up receive their stored tensors:
    the tokens are the dequantized float checkpoint's, in transformers too."""
    from transformers import AutoModelForCausalLM

    quantized, dequantized = _write_rowint8(tmp_path)
    tokens = _greedy(quantized)
    assert RowInt8Method.built_with == {"quant_method": FORMAT, "bits": 8}
    assert len(RowInt8Method.created) == 2 * 4  # per layer: qkv, o, gate_up, down
    assert all(not prefix.endswith("lm_head") for prefix in RowInt8Method.created)
    layer = "model.layers.1.self_attn"
    assert RowInt8Method.modules[f"{layer}.qkv_proj"] == [f"{layer}.q_proj", f"{layer}.k_proj", f"{layer}.v_proj"]
    assert RowInt8Method.modules["model.layers.1.mlp.gate_up_proj"] == [
        "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"]
    assert RowInt8Method.modules[f"{layer}.o_proj"] == [f"{layer}.o_proj"]
    hf = AutoModelForCausalLM.from_pretrained(str(dequantized), dtype=torch.float32)
    for prompt, got in zip(PROMPTS, tokens, strict=True):
        ids = torch.tensor([prompt])
        expected = hf.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None)[0, len(prompt):].tolist()
        assert got == expected


def test_a_method_that_does_not_read_the_checkpoint_format_is_refused(rowint8_plugin: None, tmp_path: Path) -> None:
    quantized, _ = _write_rowint8(tmp_path)
    with pytest.raises(ConfigError, match=r"model.quantization='int8' is invalid; allowed: a method that reads the "
                                          r"checkpoint's 'rowint8' format \(rowint8\)"):
        LLM(model=str(quantized), dtype="float32", quantization="int8")


def test_a_method_that_only_reads_its_format_refuses_a_float_checkpoint(rowint8_plugin: None) -> None:
    with pytest.raises(ConfigError, match=r"model.quantization='rowint8' is invalid; allowed: a method that "
                                          r"quantizes a float checkpoint at load"):
        LLM(model=str(cached_tiny_model("llama")), dtype="float32", quantization=FORMAT)
