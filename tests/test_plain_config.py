"""config.json of a known architecture read without transformers gives what
AutoConfig gives: every attribute, the architecture's defaults for missing
fields and the derived ones (head_dim, KV heads, rope parameters, dtype)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers.tiny_models import cached_tiny_model
from transformers import AutoConfig, LlamaConfig, PretrainedConfig

from pagedllm.model_registry.loader import load_hf_config
from pagedllm.model_registry.model_source import resolve_model_path
from pagedllm.model_registry.plain_config import LLAMA_DEFAULTS, PlainConfig, read_plain_config

VARIANTS: dict[str, dict[str, Any]] = {
    "only the type": {"model_type": "llama"},
    "top-level rope_theta, bf16": {
        "model_type": "llama", "rope_theta": 500000.0, "hidden_size": 256, "num_attention_heads": 4,
        "torch_dtype": "bfloat16", "architectures": ["LlamaForCausalLM"],
    },
    "rope type only, explicit heads": {
        "model_type": "llama", "rope_parameters": {"rope_type": "default"}, "dtype": "float32",
        "num_key_value_heads": 8, "head_dim": 32, "eos_token_id": [1, 2], "tie_word_embeddings": True,
        "some_new_field": {"kept": True},
    },
}


def write_config(folder: Path, config: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def assert_same_as_autoconfig(folder: Path) -> None:
    plain = read_plain_config(folder)
    assert isinstance(plain, PlainConfig)
    hf = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    for key, value in plain.to_dict().items():
        assert getattr(hf, key) == value, key
    # and nothing transformers reads from config.json (or defaults differently) is missing
    for key in hf.to_diff_dict():
        if key != "transformers_version":
            assert getattr(plain, key) == getattr(hf, key), key


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_a_llama_config_reads_as_autoconfig_reads_it(tmp_path: Path, name: str) -> None:
    assert_same_as_autoconfig(write_config(tmp_path, VARIANTS[name]))


def test_the_shipped_model_and_a_saved_llama_read_as_autoconfig_reads_them(tmp_path: Path) -> None:
    for source in (Path(resolve_model_path("tiny")), cached_tiny_model("llama")):
        folder = tmp_path / source.name
        shutil.copy(source / "config.json", write_config(folder, {}) / "config.json")
        assert_same_as_autoconfig(folder)


def test_the_defaults_are_transformers_llama_defaults() -> None:
    fields = LlamaConfig.__dataclass_fields__
    assert {key: fields[key].default for key in LLAMA_DEFAULTS} == LLAMA_DEFAULTS


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "qwen2"},
        {"model_type": "llama", "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}},
        {"model_type": "llama", "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
        {"model_type": "llama", "auto_map": {"AutoConfig": "custom.Config"}},
    ],
)
def test_what_transformers_rewrites_goes_through_autoconfig(tmp_path: Path, config: dict[str, Any]) -> None:
    folder = write_config(tmp_path, config)
    assert read_plain_config(folder) is None
    if "auto_map" not in config:  # AutoConfig would want the custom code
        assert isinstance(load_hf_config(folder), PretrainedConfig)


def test_heads_that_do_not_divide_the_hidden_size_are_refused_as_transformers_refuses_them(tmp_path: Path) -> None:
    folder = write_config(tmp_path, {"model_type": "llama", "hidden_size": 100, "num_attention_heads": 3})
    with pytest.raises(Exception, match=r"hidden size \(100\) is not a multiple"):  # a hub StrictDataclass error
        AutoConfig.from_pretrained(str(folder))
    with pytest.raises(ValueError, match=r"hidden size \(100\) is not a multiple"):
        read_plain_config(folder)
