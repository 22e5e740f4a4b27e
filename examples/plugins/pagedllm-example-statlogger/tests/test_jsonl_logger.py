"""jsonl: selected by name through the entry point, it writes one line per
step and per finished request with the figures the engine reported; and it
passes the stat-logger conformance suite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams


def _installed() -> bool:
    from pagedllm.plugins import get_plugin_manager

    get_plugin_manager().load()
    return "jsonl" in get_plugin_manager().stat_loggers


@pytest.fixture
def stats_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    if not _installed():
        pytest.skip("the package is not installed (pip install -e examples/plugins/pagedllm-example-statlogger)")
    path = tmp_path / "stats.jsonl"
    # The plugin option, set the way a deployment sets it: by environment.
    monkeypatch.setenv("PAGEDLLM_PLUGINS__CONFIG__EXAMPLE_STATLOGGER__PATH", str(path))
    return path


def test_lines_carry_each_step_and_each_finished_request(stats_path: Path) -> None:
    llm = LLM(model="tiny", dtype="float32", num_kv_blocks=64, stat_loggers=["jsonl"])
    prompts = [{"prompt_token_ids": list(range(100, 120))}, {"prompt_token_ids": list(range(200, 213))}]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    llm.shutdown()
    lines = [json.loads(line) for line in stats_path.read_text().splitlines()]

    assert lines[0] == {"event": "engine_initialized", "model_name": "pagedllm-tiny", "num_kv_blocks": 64,
                        "custom_metrics": []}
    steps = [line for line in lines if line["event"] == "step"]
    # Both prompts prefill in one step (20 + 13 tokens), then 4 decode steps of 2.
    assert [step["num_scheduled_tokens"] for step in steps] == [33, 2, 2, 2, 2]
    assert [step["iteration"]["num_generation_tokens"] for step in steps] == [2, 2, 2, 2, 2]
    assert sum(step["iteration"]["num_prompt_tokens"] for step in steps) == 33
    assert [step["scheduler"]["num_running_reqs"] for step in steps] == [2, 2, 2, 2, 0]
    assert steps[0]["scheduler"]["prefix_cache_queries"] == 33
    finished = sorted(
        (line["num_prompt_tokens"], line["num_generation_tokens"], line["finish_reason"], line["max_tokens_param"])
        for line in lines if line["event"] == "finished"
    )
    assert finished == [(13, 5, "length", 5), (20, 5, "length", 5)]


def test_jsonl_passes_the_stat_logger_conformance_suite(
    stats_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagedllm.testing import run_suite

    workdir = tmp_path / "workdir"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    run_suite("stat_logger", "jsonl")
    # The suite runs each rule in a scratch directory: the logger's default
    # relative path leaves nothing where the suite was started.
    assert list(workdir.iterdir()) == []
