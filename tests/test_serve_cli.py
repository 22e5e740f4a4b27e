"""`pagedllm serve` arguments: a flag for every EngineConfig field, and the
precedence flags > env > config file > defaults."""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any, Literal

import pytest

from pagedllm.core.config import EngineConfig
from pagedllm.entrypoints.cli import build_parser, main, serve_config
from pagedllm.entrypoints.config_flags import flag_names, section_models


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("PAGEDLLM_") and name not in ("PAGEDLLM_CACHE_DIR", "PAGEDLLM_LOG_LEVEL"):
            monkeypatch.delenv(name)


def config_for(*argv: str) -> EngineConfig:
    return serve_config(build_parser().parse_args(["serve", *argv]))


def _sample_argv(flag: str, field: Any) -> tuple[list[str], Any]:
    """Command-line words setting the field to a non-default value, and that value."""
    kind = field.annotation
    if typing.get_origin(kind) in (typing.Union, types.UnionType):  # X | None
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
    default = field.get_default(call_default_factory=True)
    if kind is bool:
        return ([f"--no-{flag[2:]}"], False) if default else ([flag], True)
    if typing.get_origin(kind) is list:
        if typing.get_args(kind) == (int,):
            return [flag, "3, 5"], [3, 5]
        return [flag, "alpha, beta"], ["alpha", "beta"]
    if typing.get_origin(kind) is dict:
        return [flag, '{"a": 1}'], {"a": 1}
    if typing.get_origin(kind) is Literal:
        choice = [c for c in typing.get_args(kind) if c != default][-1]
        return [flag, str(choice)], choice
    if kind is int:
        return [flag, str((default or 0) + 1)], (default or 0) + 1
    if kind is float:
        return [flag, "0.5"], 0.5
    return [flag, "some-name"], "some-name"


# Flags a field's sample value needs beside it (a value checked against another field).
_CONTEXT_ARGV = {("parallel", "data_parallel_rank"): ["--data-parallel-size", "2"]}
# Fields whose flag takes another shape than their type's: one plugin's options as NAME=JSON.
_SPECIAL_ARGV: dict[tuple[str, str], tuple[list[str], Any]] = {
    ("plugins", "config"): (["--plugin-config", 'p={"a": 1}'], {"p": {"a": 1}}),
    # vLLM's nargs="+": one word per name.
    ("server", "served_model_name"): (["--served-model-name", "alpha", "beta"], ["alpha", "beta"]),
    ("lora", "lora_modules"): (["--lora-modules", "sql=/a", '{"name": "b", "path": "/b"}'],
                               ["sql=/a", '{"name": "b", "path": "/b"}']),
    # auto, vllm or a folder that holds a generation_config.json.
    ("model", "generation_config"): (["--generation-config", "vllm"], "vllm"),
}


def test_every_engine_config_field_has_a_working_flag() -> None:
    names = flag_names()
    checked = 0
    for section, model in section_models().items():
        for key, field in model.model_fields.items():
            if (section, key) == ("model", "model"):
                continue  # the MODEL positional
            flag = "--" + names[(section, key)].replace("_", "-")
            argv, expected = _SPECIAL_ARGV.get((section, key)) or _sample_argv(flag, field)
            argv += _CONTEXT_ARGV.get((section, key), [])
            assert getattr(getattr(config_for(*argv), section), key) == expected, argv
            checked += 1
    assert checked >= 25
    assert names[("cache", "block_size")] == "block_size"
    assert names[("plugins", "enabled")] == "enabled_plugins"
    assert names[("server", "api_key")] == "api_key"


def test_flags_beat_env_beat_file_beat_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = tmp_path / "engine.yaml"
    config_file.write_text("cache:\n  block_size: 8\nscheduler:\n  max_num_seqs: 4\nserver:\n  port: 9000\n")
    monkeypatch.setenv("PAGEDLLM_CACHE__BLOCK_SIZE", "32")
    monkeypatch.setenv("PAGEDLLM_SERVER__PORT", "9100")
    config = config_for("--config", str(config_file), "--block-size", "64")
    assert config.cache.block_size == 64  # flag over env and file
    assert config.server.port == 9100  # env over file
    assert config.scheduler.max_num_seqs == 4  # file over default
    assert config.scheduler.max_num_batched_tokens == 2048  # default


def test_api_key_from_pagedllm_api_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_file = tmp_path / "engine.toml"
    config_file.write_text('[server]\napi_key = "from-file"\n')
    assert config_for("--config", str(config_file)).server.api_key == "from-file"
    monkeypatch.setenv("PAGEDLLM_API_KEY", "from-env")
    assert config_for("--config", str(config_file)).server.api_key == "from-env"
    assert config_for("--config", str(config_file), "--api-key", "from-flag").server.api_key == "from-flag"


def test_model_positional_or_flag_and_plugins_selected_by_name(tmp_path: Path) -> None:
    config_file = tmp_path / "engine.toml"
    config_file.write_text('[device]\nattention_backend = "torch_native"\n[plugins]\ndisabled = ["some_plugin"]\n')
    config = config_for("/models/a", "--config", str(config_file), "--no-enable-prefix-caching")
    assert (config.model.model, config.device.attention_backend) == ("/models/a", "torch_native")
    assert (config.plugins.disabled, config.cache.enable_prefix_caching) == (["some_plugin"], False)
    assert config_for("--model", "/models/b").model.model == "/models/b"
    assert config_for().model.model is None  # the embedded default model


def test_bad_values_are_reported_not_served(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--block-size", "many"]) == 2  # argparse: not an integer
    assert main(["serve", "--scheduling-policy", "lifo"]) == 1
    assert "scheduler.scheduling_policy" in capsys.readouterr().err
