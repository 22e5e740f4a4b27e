from __future__ import annotations

import os
from pathlib import Path

import pytest

from pagedllm.core.config import FLAT_KEYS, CacheConfig, EngineConfig, SchedulerConfig
from pagedllm.core.errors import ConfigError

YAML_FILE = """\
cache:
  block_size: 32
  num_kv_blocks: 100
scheduler:
  max_num_seqs: 7
  scheduling_policy: priority
"""
TOML_FILE = """\
[cache]
block_size = 32
num_kv_blocks = 100

[scheduler]
max_num_seqs = 7
scheduling_policy = "priority"
"""


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.upper().startswith("PAGEDLLM_"):
            monkeypatch.delenv(name)


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_defaults_match_vllm() -> None:
    c = EngineConfig()
    assert c.model.model is None and c.model.dtype == "auto" and c.model.seed == 0
    assert (c.cache.block_size, c.cache.enable_prefix_caching, c.cache.prefix_caching_hash_algo) == (16, True, "sha256")
    assert c.cache.gpu_memory_utilization == 0.9 and c.cache.num_kv_blocks is None
    assert (c.scheduler.max_num_batched_tokens, c.scheduler.max_num_seqs) == (2048, 128)
    assert (c.scheduler.scheduling_policy, c.scheduler.enable_chunked_prefill) == ("fcfs", True)
    assert c.scheduler.long_prefill_token_threshold == 0
    assert (c.device.platform, c.device.attention_backend) == ("auto", "auto")
    assert (c.plugins.enabled, c.plugins.disabled, c.plugins.strict) == (None, [], False)


@pytest.mark.parametrize(("name", "text"), [("engine.yaml", YAML_FILE), ("engine.toml", TOML_FILE)])
def test_precedence_is_init_over_env_over_file_over_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str
) -> None:
    path = _write(tmp_path, name, text)
    monkeypatch.setenv("PAGEDLLM_CACHE__BLOCK_SIZE", "64")
    monkeypatch.setenv("PAGEDLLM_SCHEDULER__MAX_NUM_SEQS", "9")
    c = EngineConfig.load(path, scheduler={"max_num_seqs": 3})
    assert c.scheduler.max_num_seqs == 3  # init beats env and file
    assert c.cache.block_size == 64  # env beats file
    assert c.cache.num_kv_blocks == 100  # file beats default
    assert c.scheduler.scheduling_policy == "priority"  # file, same section as an init key
    assert c.scheduler.max_num_batched_tokens == 2048  # default


def test_section_model_override_only_pins_the_fields_it_sets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_CACHE__BLOCK_SIZE", "64")
    c = EngineConfig.load(cache=CacheConfig(num_kv_blocks=5), scheduler=SchedulerConfig(max_num_seqs=2))
    assert (c.cache.block_size, c.cache.num_kv_blocks, c.scheduler.max_num_seqs) == (64, 5, 2)


def test_unknown_key_in_arguments_lists_the_sections_known_keys() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(cache={"blok_size": 8})
    assert info.value.key == "cache.blok_size"
    assert "block_size" in info.value.allowed and "num_kv_blocks" in info.value.allowed
    with pytest.raises(ConfigError) as info:
        EngineConfig(speculatve={"method": "ngram"})
    assert info.value.key == "speculatve"
    assert info.value.allowed == (
        "known keys model, cache, scheduler, device, plugins, structured_output, speculative, kv_transfer, parallel, "
        "server, lora"
    )


def test_unknown_key_in_env_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_SCHEDULER__MAX_SEQS", "4")
    with pytest.raises(ConfigError) as info:
        EngineConfig()
    assert info.value.key == "scheduler.max_seqs"
    assert "max_num_seqs" in info.value.allowed


def test_unrelated_pagedllm_env_vars_are_not_config_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    # Other parts read e.g. PAGEDLLM_TRACE_PLUGINS; they are not sections.
    monkeypatch.setenv("PAGEDLLM_TRACE_PLUGINS", "1")
    assert EngineConfig().cache.block_size == 16


def test_unknown_key_in_file_is_an_error(tmp_path: Path) -> None:
    path = _write(tmp_path, "bad.yaml", "device:\n  backend: triton\n")
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(path)
    assert info.value.key == "device.backend"
    assert info.value.allowed == (
        "known keys platform, attention_backend, enforce_eager, graph_sizes, compile_model"
    )


def test_bad_literal_names_key_path_and_allowed_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_SCHEDULER__SCHEDULING_POLICY", "lifo")
    with pytest.raises(ConfigError) as info:
        EngineConfig()
    assert str(info.value) == "scheduler.scheduling_policy='lifo' is invalid; allowed: 'fcfs', 'priority'"
    monkeypatch.delenv("PAGEDLLM_SCHEDULER__SCHEDULING_POLICY")
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(cache={"prefix_caching_hash_algo": "md5"})
    assert info.value.allowed == "'sha256', 'xxhash'"


@pytest.mark.parametrize(
    ("section", "key", "value", "allowed"),
    [
        ("cache", "block_size", 0, ">= 1 and <= 256"),
        ("cache", "gpu_memory_utilization", 1.5, "> 0.0 and <= 1.0"),
        ("scheduler", "max_num_batched_tokens", 0, ">= 1"),
        ("scheduler", "max_num_seqs", -1, ">= 1"),
        ("scheduler", "long_prefill_token_threshold", -1, ">= 0"),
    ],
)
def test_out_of_range_values_name_the_bound(section: str, key: str, value: object, allowed: str) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(**{section: {key: value}})
    assert (info.value.key, info.value.value, info.value.allowed) == (f"{section}.{key}", value, allowed)


def test_dtype_aliases() -> None:
    assert [EngineConfig.load(model={"dtype": d}).model.dtype for d in ("half", "float", "bf16", "BFloat16")] == [
        "float16", "float32", "bfloat16", "bfloat16"]
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(model={"dtype": "int8"})
    assert info.value.key == "model.dtype"
    assert "'bfloat16'" in info.value.allowed and "half" in info.value.allowed


def test_missing_file_and_unknown_extension_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(tmp_path / "nope.yaml")
    assert info.value.key == "config_file"
    with pytest.raises(ConfigError) as info:
        EngineConfig.load(_write(tmp_path, "engine.json", "{}"))
    assert "toml" in info.value.allowed
    with pytest.raises(ConfigError):
        EngineConfig.load(_write(tmp_path, "list.yaml", "- 1\n"))
    with pytest.raises(ConfigError):
        EngineConfig.load(_write(tmp_path, "broken.toml", "[cache\n"))


def test_dotenv_file_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write(tmp_path, ".env", "PAGEDLLM_CACHE__BLOCK_SIZE=8\n")
    monkeypatch.chdir(tmp_path)
    assert EngineConfig().cache.block_size == 16


def test_env_plugins_list_accepts_commas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDLLM_PLUGINS__ENABLED", "alpha, beta")
    monkeypatch.setenv("PAGEDLLM_PLUGINS__STRICT", "true")
    c = EngineConfig()
    assert (c.plugins.enabled, c.plugins.strict) == (["alpha", "beta"], True)


def test_from_flat_maps_vllm_names_to_sections(tmp_path: Path) -> None:
    c = EngineConfig.from_flat(
        model="/models/x", dtype="half", max_model_len=512, seed=3, block_size=32,
        num_gpu_blocks_override=64, enable_prefix_caching=False, max_num_seqs=4,
        max_num_batched_tokens=256, scheduling_policy="priority", attention_backend="torch_native",
        enabled_plugins=["a"], strict_plugins=True, load_format="pt", logits_processors="p1, p2",
        model_impl="transformers", revision="v1", tokenizer_revision="v2", download_dir="/hf",
        trust_remote_code=True, generation_config="vllm", override_generation_config={"top_p": 0.9},
    )
    d = c.to_dict()
    assert d["model"] == {"model": "/models/x", "tokenizer": None, "dtype": "float16", "max_model_len": 512,
                          "seed": 3, "architecture": None, "model_impl": "transformers", "quantization": None,
                          "load_format": "pt", "revision": "v1", "tokenizer_revision": "v2", "download_dir": "/hf",
                          "logits_processors": ["p1", "p2"], "trust_remote_code": True,
                          "generation_config": "vllm", "override_generation_config": {"top_p": 0.9}}
    cache = d["cache"]
    assert (cache["block_size"], cache["num_kv_blocks"], cache["enable_prefix_caching"]) == (32, 64, False)
    assert (d["scheduler"]["max_num_seqs"], d["scheduler"]["max_num_batched_tokens"]) == (4, 256)
    assert d["scheduler"]["scheduling_policy"] == "priority"
    assert d["device"] == {"platform": "auto", "attention_backend": "torch_native", "enforce_eager": False,
                           "graph_sizes": None, "compile_model": False}
    assert d["plugins"] == {"enabled": ["a"], "disabled": [], "strict": True, "config": {}}


def test_from_flat_none_means_default_and_file_still_applies(tmp_path: Path) -> None:
    c = EngineConfig.from_flat(_write(tmp_path, "e.yaml", YAML_FILE), block_size=None, max_num_seqs=2)
    assert (c.cache.block_size, c.scheduler.max_num_seqs, c.cache.num_kv_blocks) == (32, 2, 100)


def test_from_flat_unknown_name_lists_accepted_names() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_flat(max_num_seq=4)
    assert info.value.key == "max_num_seq"
    assert "max_num_seqs" in info.value.allowed and "num_gpu_blocks_override" in info.value.allowed
    assert set(FLAT_KEYS) <= set(info.value.allowed.removeprefix("one of ").split(", "))


def test_from_flat_alias_and_name_together_is_an_error() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_flat(num_kv_blocks=4, num_gpu_blocks_override=8)
    assert info.value.key == "num_gpu_blocks_override"


def test_bad_flat_value_names_the_section_key() -> None:
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_flat(prefix_caching_hash_algo="sha1")
    assert info.value.key == "cache.prefix_caching_hash_algo"


def test_speculative_section_from_file_flat_kwargs_and_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineConfig.from_flat(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert config.speculative.method == "ngram" and config.speculative.num_speculative_tokens == 5
    path = tmp_path / "engine.yaml"
    path.write_text("speculative:\n  method: draft_model\n  model: tiny-draft\n  num_speculative_tokens: 4\n")
    config = EngineConfig.load(path)
    assert (config.speculative.method, config.speculative.model) == ("draft_model", "tiny-draft")
    monkeypatch.setenv("PAGEDLLM_SPECULATIVE__PROMPT_LOOKUP_MAX", "6")
    assert EngineConfig().speculative.prompt_lookup_max == 6
    with pytest.raises(ConfigError) as info:
        EngineConfig.from_flat(speculative_config={"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 2})
    assert info.value.key == "speculative.prompt_lookup_max"
    assert "prompt_lookup_min (5)" in info.value.allowed


def test_speculative_flags_reach_the_section() -> None:
    import argparse

    from pagedllm.entrypoints.config_flags import add_engine_config_flags, engine_config_overrides

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_engine_config_flags(parser)
    args = parser.parse_args(
        ["--speculative-method", "draft_model", "--speculative-model", "tiny-draft", "--num-speculative-tokens", "4"]
    )
    overrides = engine_config_overrides(args)
    assert overrides["speculative"] == {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 4}
    assert EngineConfig.load(**overrides).speculative.num_speculative_tokens == 4
