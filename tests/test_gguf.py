"""GGUF checkpoints (llama.cpp's files) against transformers' own GGUF loading.

The files are written here from a tiny float Llama (tests/helpers/gguf_writer.py):
F16, Q8_0 and Q4_K_M (Q4_K with Q6_K for output, attn_v and ffn_down of the
last layer). Q8_0 / Q6_K / Q4_K linear weights stay quantized (the "gguf"
quantization method on the grouped 8/4-bit layout). The hidden size is 256 because K-quant super-blocks are 256 wide.
transformers' reference is its GGUF reader (`load_gguf_checkpoint`: dequantize,
rename, undo the q/k permutation) into a model built from the file's config;
`from_pretrained(gguf_file=...)` does the same but needs `accelerate`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from helpers.gguf_writer import write_gguf
from helpers.tiny_models import cached_tiny_model

from pagedllm.engine.async_llm import served_name_of
from pagedllm.model_registry.gguf_checkpoint import KEPT_QUANTIZED_TYPES, iterate_gguf
from pagedllm.model_registry.loader import ModelLoadError, load_hf_config, load_model, resolve_load_format
from pagedllm.model_registry.tokenizer import load_tokenizer
from pagedllm.quantization.gguf import GGUFMethod
from pagedllm.quantization.gguf_convert import convert_gguf_tensor
from pagedllm.worker.quantize import create_checkpoint_weights, quantize_model

PRESETS = ("F16", "Q8_0", "Q4_K_M")
SIZES = dict(hidden_size=256, intermediate_size=512, head_dim=64)


@pytest.fixture(scope="module")
def hf_folder() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, **SIZES)


@pytest.fixture(scope="module")
def gguf_files(hf_folder: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gguf")
    return {preset: write_gguf(hf_folder, folder / f"tiny-llama.{preset}.gguf", preset) for preset in PRESETS}


_references: dict[Path, tuple[Any, dict[str, torch.Tensor]]] = {}


def transformers_reference(gguf_file: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    """(model, its state dict) as transformers loads the file, once per file."""
    if gguf_file not in _references:
        _references[gguf_file] = _load_reference(gguf_file)
    return _references[gguf_file]


def _load_reference(gguf_file: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = AutoConfig.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    tensors = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=model)["tensors"]
    model.load_state_dict(tensors, strict=True)
    return model.eval(), tensors


@pytest.mark.parametrize("preset", PRESETS)
def test_dequantized_tensors_equal_transformers_gguf_reader(preset: str, gguf_files: dict[str, Path]) -> None:
    _, expected = transformers_reference(gguf_files[preset])
    ours = dict(iterate_gguf(gguf_files[preset], keep_quantized=False))
    assert sorted(ours) == sorted(expected)
    for name, tensor in ours.items():
        assert torch.equal(tensor, expected[name]), name


def test_q4_k_m_file_mixes_q4_k_and_q6_k(gguf_files: dict[str, Path]) -> None:
    from gguf import GGUFReader

    types = {tensor.name: tensor.tensor_type.name for tensor in GGUFReader(gguf_files["Q4_K_M"]).tensors}
    assert types["output.weight"] == types["blk.1.attn_v.weight"] == types["blk.1.ffn_down.weight"] == "Q6_K"
    assert types["token_embd.weight"] == types["blk.0.attn_v.weight"] == types["blk.0.attn_q.weight"] == "Q4_K"
    assert types["blk.0.attn_norm.weight"] == "F32"


def _load_quantized(gguf_file: Path) -> torch.nn.Module:
    from pagedllm.attention_backends.torch_native import TorchNativeBackend
    from pagedllm.model_registry.models.llama import LlamaForCausalLM

    config = load_hf_config(gguf_file)
    method = GGUFMethod.from_checkpoint_config(config.quantization_config)
    model = load_model(gguf_file, model_cls=LlamaForCausalLM, attn_backend=TorchNativeBackend, dtype=torch.float32,
                       device="cpu", hf_config=config,
                       create_quantized_weights=lambda built: create_checkpoint_weights(built, method))
    quantize_model(model, method)
    return model


# (layer, stacked module) -> (bits, group size, offsets) each preset keeps;
# layer 1's q/k (Q4_K) and v (Q6_K) share one exact W8 layout.
EXPECTED_LAYOUTS = {
    "Q8_0": {(layer, module): (8, 32, False) for layer in (0, 1) for module in ("qkv", "o", "gate_up", "down")},
    "Q4_K_M": {(0, "qkv"): (4, 32, True), (0, "o"): (4, 32, True), (0, "gate_up"): (4, 32, True),
               (0, "down"): (4, 32, True), (1, "qkv"): (8, 16, True), (1, "o"): (4, 32, True),
               (1, "gate_up"): (4, 32, True), (1, "down"): (8, 16, False)},
}
MODULES = {"qkv": ("self_attn.qkv_proj", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]),
           "o": ("self_attn.o_proj", ["self_attn.o_proj"]),
           "gate_up": ("mlp.gate_up_proj", ["mlp.gate_proj", "mlp.up_proj"]),
           "down": ("mlp.down_proj", ["mlp.down_proj"])}


@pytest.mark.parametrize("preset", ["Q8_0", "Q4_K_M"])
def test_quantized_layers_hold_grouped_weights_equal_to_transformers(preset: str, gguf_files: dict[str, Path]) -> None:
    """Every linear layer keeps its GGUF storage in the grouped layout, and
    that storage dequantizes bit for bit to transformers' tensors (the
    stacked layers' shards in order, q/k rows unpermuted)."""
    _, expected = transformers_reference(gguf_files[preset])
    modules = dict(_load_quantized(gguf_files[preset]).named_modules())
    for layer in (0, 1):
        for module, (ours, shards) in MODULES.items():
            weight = modules[f"model.layers.{layer}.{ours}"].gguf_weight
            layout = (weight.bits, weight.group_size, weight.offsets is not None)
            assert layout == EXPECTED_LAYOUTS[preset][layer, module], (layer, module)
            reference = torch.cat([expected[f"model.layers.{layer}.{shard}.weight"] for shard in shards])
            assert torch.equal(weight.dequantize(), reference), (layer, module)


def test_kept_types_are_exactly_those_gguf_convert_converts() -> None:
    from gguf import GGML_QUANT_SIZES

    for tensor_type, (block_size, type_size) in GGML_QUANT_SIZES.items():
        converted = convert_gguf_tensor(np.zeros((1, 256 // block_size * type_size), np.uint8), tensor_type, [1, 256])
        assert (converted is not None) == (tensor_type.name in KEPT_QUANTIZED_TYPES), tensor_type.name


def test_an_f16_file_is_a_float_checkpoint(gguf_files: dict[str, Path]) -> None:
    assert getattr(load_hf_config(gguf_files["F16"]), "quantization_config", None) is None
    assert load_hf_config(gguf_files["Q8_0"]).quantization_config["quant_method"] == "gguf"


def test_quantization_other_than_gguf_is_refused_for_a_quantized_file(gguf_files: dict[str, Path]) -> None:
    from pagedllm import LLM
    from pagedllm.core.errors import ConfigError

    with pytest.raises(ConfigError, match=r"model.quantization='int8' is invalid; allowed: a method that reads the "
                                          r"checkpoint's 'gguf' format \(gguf\)"):
        LLM(model=str(gguf_files["Q4_K_M"]), dtype="float32", quantization="int8")
    with pytest.raises(ConfigError, match=r"model.quantization='gguf' is invalid; allowed: a method that quantizes "
                                          r"a float checkpoint at load"):
        LLM(model=str(cached_tiny_model("llama")), dtype="float32", quantization="gguf")


# The engine on the kept-quantized files: the float one's weights are
# checked bit for bit above, and the model over paged attention in test_models.
@pytest.mark.parametrize("preset", ["Q8_0", "Q4_K_M"])
def test_llm_greedy_tokens_equal_transformers_on_gguf(preset: str, gguf_files: dict[str, Path]) -> None:
    from pagedllm import LLM, SamplingParams

    reference, _ = transformers_reference(gguf_files[preset])
    llm = LLM(model=str(gguf_files[preset]), dtype="float32", num_kv_blocks=32)
    prompts = ["The quick brown fox", "Hello, world"]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0))
    for prompt, output in zip(prompts, outputs, strict=True):
        prompt_ids = llm.get_tokenizer().encode(prompt)
        with torch.no_grad():
            expected = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False,
                                          eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):]
        assert list(output.outputs[0].token_ids) == expected.tolist()


@pytest.mark.slow  # two rank processes: ~30 s on two busy cores
def test_q4_k_m_at_tensor_parallel_size_2_equals_transformers(gguf_files: dict[str, Path]) -> None:
    """Each rank slices the kept codes, scales and offsets of its shards
    (row-parallel layers along whole groups): the tokens stay transformers'."""
    from pagedllm import LLM, SamplingParams

    reference, _ = transformers_reference(gguf_files["Q4_K_M"])
    llm = LLM(model=str(gguf_files["Q4_K_M"]), dtype="float32", num_kv_blocks=32, tensor_parallel_size=2,
              distributed_executor_backend="mp")
    try:
        prompt_ids = llm.get_tokenizer().encode("The quick brown fox")
        output = llm.generate([{"prompt_token_ids": prompt_ids}], SamplingParams(max_tokens=6, temperature=0.0))[0]
    finally:
        llm.shutdown()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt_ids]), max_new_tokens=6, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)[0, len(prompt_ids):]
    assert list(output.outputs[0].token_ids) == expected.tolist()


def test_tokenizer_from_gguf_metadata_matches_hf_tokenizer(hf_folder: Path, gguf_files: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    ours = load_tokenizer(str(gguf_files["F16"]))
    reference = AutoTokenizer.from_pretrained(str(hf_folder))
    for text in ["Hello world, this is a test.", "  two spaces\nand lines", "<|im_start|>user\nhi<|im_end|><|eos|>"]:
        assert ours.encode(text) == reference.encode(text)
    assert (ours.bos_token_id, ours.eos_token_id) == (reference.bos_token_id, reference.eos_token_id)


def test_gguf_path_selects_gguf_format_and_config(gguf_files: dict[str, Path]) -> None:
    config = load_hf_config(gguf_files["Q8_0"])
    assert config.architectures == ["LlamaForCausalLM"]
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim) == (256, 2, 64)
    assert resolve_load_format(gguf_files["Q8_0"], "auto") == "gguf"


def test_served_name_of_a_gguf_file_is_its_stem(gguf_files: dict[str, Path]) -> None:
    from pagedllm.entrypoints.cli import build_parser, serve_config

    args = build_parser().parse_args(["serve", str(gguf_files["Q8_0"]), "--tokenizer", "/models/tok"])
    config = serve_config(args)
    assert (config.model.model, config.model.tokenizer) == (str(gguf_files["Q8_0"]), "/models/tok")
    assert served_name_of(config.model.model) == "tiny-llama.Q8_0"


def _write_small_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray]) -> Path:
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    for name, values in tensors.items():
        raw_dtype = GGMLQuantizationType.I8 if values.dtype == np.int8 else None
        writer.add_tensor(name, values, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_architecture_is_a_model_load_error(tmp_path: Path) -> None:
    path = _write_small_gguf(tmp_path / "m.gguf", "gemma2", {"output_norm.weight": np.ones(4, np.float32)})
    with pytest.raises(ModelLoadError, match=r"general.architecture='gemma2' is not supported; supported: llama"):
        load_hf_config(path)


def test_gguf_tensor_of_a_type_that_cannot_be_dequantized_is_named(tmp_path: Path) -> None:
    path = _write_small_gguf(tmp_path / "m.gguf", "llama", {
        "output_norm.weight": np.ones(4, np.float32), "blk.0.attn_norm.weight": np.ones(4, np.int8),
    })
    with pytest.raises(ModelLoadError, match=r"cannot be dequantized: blk\.0\.attn_norm\.weight \(I8\)"):
        list(iterate_gguf(path))


def test_a_file_that_is_not_gguf_is_a_model_load_error(tmp_path: Path) -> None:
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        load_hf_config(path)


def test_without_the_gguf_package_the_error_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    path = _write_small_gguf(tmp_path / "m.gguf", "llama", {"output_norm.weight": np.ones(4, np.float32)})
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))
    with pytest.raises(ModelLoadError, match=r"needs the gguf package: pip install 'pagedllm\[gguf\]'"):
        load_hf_config(path)
