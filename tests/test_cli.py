"""`pagedllm plugins list` and `pagedllm env` through main([...])."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
from typing import Any

import pytest
import torch

import pagedllm.plugins
from pagedllm.entrypoints.cli import main
from pagedllm.plugins import KINDS, PluginManager

_real_find_spec = importlib.util.find_spec
TEST_DIST_SOURCE = f"pagedllm-test-plugin {importlib.metadata.version('pagedllm-test-plugin')}"


def simulate_device(
    monkeypatch: pytest.MonkeyPatch, capability: tuple[int, int] | None, installed: tuple[str, ...] = ("triton",)
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: capability is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Simulated GPU")

    def find_spec(name: str, package: str | None = None) -> Any:
        if name in ("triton", "flash_attn"):
            return object() if name in installed else None
        return _real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> Any:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_plugins_list_json_shows_every_kind_name_and_source(capsys: pytest.CaptureFixture[str]) -> None:
    payload = run_json(capsys, ["plugins", "list", "--json"])
    assert list(payload["components"]) == list(KINDS)
    backends = {c["name"]: c["source"] for c in payload["components"]["attention_backend"]}
    assert backends == {
        "cpu": "builtin",
        "triton": "builtin",
        "flash_attn": "builtin",
        "test_echo": TEST_DIST_SOURCE,
        # installed by `make install` like any user plugin (tests/test_example_plugins.py)
        "sdpa": f"pagedllm-example-attention {importlib.metadata.version('pagedllm-example-attention')}",
    }
    models = {c["name"]: c["target"] for c in payload["components"]["model"]}
    assert models["TestEchoForCausalLM"] == "pagedllm_test_plugin.model:TestEchoForCausalLM"
    flash = next(c for c in payload["components"]["attention_backend"] if c["name"] == "flash_attn")
    assert flash["metadata"]["min_capability"] == [8, 0]
    [test_plugin] = [p for p in payload["plugins"] if p["name"] == "pagedllm_test_plugin"]
    assert test_plugin == {
        "name": "pagedllm_test_plugin",
        "source": TEST_DIST_SOURCE,
        "distribution": "pagedllm-test-plugin",
        "version": TEST_DIST_SOURCE.split()[1],
        "api_range": None,  # it declares no PAGEDLLM_API_VERSION
        "api_compatible": True,
        "api": "undeclared",
        # its own options (tests/test_plugin_config.py): none set, the model's defaults
        "config_model": "pagedllm_test_plugin.options:TestPluginOptions",
        "options": {"record_path": None, "label": "default", "scale": 1, "mode": "exact", "tiers": []},
    }
    assert payload["load_errors"] == []
    assert payload["api_version"] == pagedllm.plugins.API_VERSION


def test_plugins_list_reports_load_errors(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    broken = importlib.metadata.EntryPoint(name="ghost", value="pagedllm_ghost_module", group="pagedllm.plugins")
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [broken])
    private = PluginManager()
    monkeypatch.setattr(pagedllm.plugins, "get_plugin_manager", lambda: private)
    payload = run_json(capsys, ["plugins", "list", "--json"])
    assert payload["load_errors"] == [
        {
            "plugin": "ghost",
            "distribution": "unknown",
            "error": "ModuleNotFoundError: No module named 'pagedllm_ghost_module'",
            "api_range": None,
        }
    ]
    assert main(["plugins", "list"]) == 0
    text = capsys.readouterr().out
    assert "ghost (unknown): ModuleNotFoundError: No module named 'pagedllm_ghost_module'" in text
    assert "attention_backend:" in text and "kv_connector:" in text


@pytest.mark.parametrize(("flags", "dtype", "reason"), [
    ({"avx512f", "amx_bf16", "avx512_bf16"}, "bfloat16",
     "auto: a bfloat16 checkpoint runs in bfloat16, which this CPU computes natively (amx_bf16, avx512_bf16)"),
    ({"avx2", "avx512f"}, "float32", "auto: a bfloat16 checkpoint runs in float32: this CPU has no native "
     "bfloat16 (none of amx_bf16, avx512_bf16, bf16, svebf16)"),
])
def test_env_json_on_cpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                         flags: set[str], dtype: str, reason: str) -> None:
    from pagedllm.platforms.cpu import platform as cpu

    monkeypatch.setattr(cpu, "read_cpu_flags", lambda: flags)
    simulate_device(monkeypatch, None)
    payload = run_json(capsys, ["env", "--json"])
    assert payload["platform"] == "cpu"
    assert payload["device_capability"] is None
    assert payload["attention_backend"] == "cpu"
    assert payload["rejected"] == {}
    # Under the Triton interpreter (this suite) triton may run on CPU, so only "auto" skips it.
    if os.environ.get("TRITON_INTERPRET") != "1":
        assert payload["backends"]["triton"][0] == "device type 'cpu' is not supported (needs cuda)"
    assert (payload["dtype"], payload["dtype_reason"]) == (dtype, reason)


def test_env_shows_the_executor_world_size_and_communicator(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    simulate_device(monkeypatch, None)
    payload = run_json(capsys, ["env", "--json"])
    assert (payload["executor"], payload["world_size"], payload["communicator"]) == ("uni", 1, "none (one rank)")
    payload = run_json(capsys, ["env", "--json", "-tp", "2"])
    assert (payload["executor"], payload["world_size"], payload["communicator"]) == (
        "mp", 2, "gloo (torch.distributed)"
    )
    simulate_device(monkeypatch, (8, 0), installed=("triton",))
    payload = run_json(capsys, ["env", "--json", "--tensor-parallel-size", "2"])
    assert (payload["executor"], payload["communicator"]) == ("mp", "nccl (torch.distributed)")
    payload = run_json(capsys, ["env", "--json", "-tp", "2", "--distributed-executor-backend", "uni"])
    assert payload["executor"] == (
        "uni (cannot run: parallel.tensor_parallel_size=2 is invalid; allowed: 1 with executor 'uni': "
        "it runs one rank (not registered with supports_tensor_parallel=True))"
    )


def test_env_shows_the_step_cost_model(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    simulate_device(monkeypatch, None)
    payload = run_json(capsys, ["env", "--json"])
    assert payload["step_cost"]["terms"] == ["step", "mixed", "token", "request", "attention"]
    assert payload["step_cost"]["auto_target"] == {"decode_factor": 3.0, "min_step_s": 0.05}
    assert payload["step_cost"]["min_prefill_tokens"] == 32
    assert payload["step_cost"]["backlog_horizon_steps"] == 16


def test_env_json_on_simulated_turing(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    simulate_device(monkeypatch, (7, 5), installed=("triton", "flash_attn"))
    payload = run_json(capsys, ["env", "--json"])
    assert payload["platform"] == "cuda"
    assert payload["device"] == "Simulated GPU"
    assert payload["device_capability"] == [7, 5]
    assert payload["attention_backend"] == "triton"
    assert payload["rejected"] == {"flash_attn": ["compute capability 7.5 < 8.0 required"]}
    assert payload["dtype"] == "float16"  # no bf16 below 8.0


def test_env_json_on_simulated_hopper_with_flash_attn(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    simulate_device(monkeypatch, (9, 0), installed=("triton", "flash_attn"))
    payload = run_json(capsys, ["env", "--json", "--head-size", "64", "--block-size", "32"])
    assert (payload["attention_backend"], payload["rejected"], payload["dtype"]) == ("flash_attn", {}, "bfloat16")


def test_env_names_the_backends_a_model_with_sinks_cannot_use(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    simulate_device(monkeypatch, (9, 0), installed=("triton", "flash_attn"))
    payload = run_json(capsys, ["env", "--json", "--head-size", "64", "--sinks", "--sliding-window", "128"])
    assert (payload["attention_backend"], payload["sinks"], payload["sliding_window"]) == ("triton", True, 128)
    assert payload["rejected"] == {"flash_attn": ["attention sinks are not supported"]}
    assert main(["env", "--head-size", "64", "--sinks"]) == 0
    text = capsys.readouterr().out
    assert "head_size=64 block_size=16 sinks" in text
    assert "  flash_attn: attention sinks are not supported" in text


def test_env_text_prints_decision_and_reasons(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    simulate_device(monkeypatch, (8, 0), installed=("triton",))
    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "attention backend:  triton" in out
    assert "  flash_attn: package 'flash_attn' is not installed" in out


def test_env_invalid_requested_backend_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    simulate_device(monkeypatch, (7, 5), installed=("triton", "flash_attn"))
    assert main(["env", "--attention-backend", "flash_attn"]) == 1
    captured = capsys.readouterr()
    assert captured.err == (
        "error: attention backend 'flash_attn' is not usable here: compute capability 7.5 < 8.0 required\n"
    )
    assert "Traceback" not in captured.out + captured.err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["env", "--platform", "tpu"], "error: no platform named 'tpu'; registered: cpu, cuda"),
        (["env", "--platform", "cuda"], "error: platform='cuda' is invalid; allowed: a platform available"),
        (["env", "--attention-backend", "xformers"], "error: no attention_backend named 'xformers'"),
        (["env", "--dtype", "float8"], "error: dtype='float8' is invalid"),
    ],
)
def test_env_user_errors_exit_nonzero_without_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    simulate_device(monkeypatch, None)
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith(message)
    assert "Traceback" not in err


def test_bad_usage_returns_argparse_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plugins"]) == 2
    assert "usage: pagedllm plugins" in capsys.readouterr().err
