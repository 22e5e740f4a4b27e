"""Custom figures end to end through a real `pagedllm serve`: a KV connector
plugin in the engine-core process attaches figures to the core's stats; they
cross the process boundary in the stats message and reach both stat loggers
the server runs in its API process (the example `jsonl` logger's file, and
the `prometheus` built-in's /metrics) with the same values."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers import custom_stats_plugin
from helpers.server import ServerProcess, start_server
from prometheus_client.parser import text_string_to_metric_families

from pagedllm.plugins import get_plugin_manager

PROMPTS = [list(range(100, 120)), list(range(200, 220))]  # 20 tokens each: 2 blocks with 3 decoded


def _jsonl_installed() -> bool:
    get_plugin_manager().load()
    return "jsonl" in get_plugin_manager().stat_loggers


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """helpers/custom_stats_plugin.py as an installed distribution whose entry
    point the server's processes load (through PYTHONPATH)."""
    return custom_stats_plugin.write_plugin_site(tmp_path_factory.mktemp("site"))


@pytest.fixture(scope="module")
def stats_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stats") / "stats.jsonl"


@pytest.fixture(scope="module")
def server(plugin_site: Path, stats_path: Path) -> Iterator[ServerProcess]:
    if not _jsonl_installed():
        pytest.skip("pagedllm-example-statlogger is not installed (make install)")
    import os

    env = {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(plugin_site), os.environ.get("PYTHONPATH")])),
    }
    args = ["--num-kv-blocks", "64", "--block-size", "16", "--dtype", "float32",
            "--kv-connector", custom_stats_plugin.CONNECTOR_NAME, "--stat-loggers", "prometheus,jsonl",
            "--plugin-config", f'example_statlogger={{"path": "{stats_path}"}}']
    with start_server(None, *args, env=env) as server:
        yield server


def _metric(server: ServerProcess, name: str) -> float:
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    [value] = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]
    return value


def _complete(server: ServerProcess, prompt: list[int]) -> None:
    model = httpx.get(f"{server.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (20, 4)


def test_a_connectors_figures_reach_metrics_and_the_jsonl_logger(server: ServerProcess, stats_path: Path) -> None:
    assert server.descendants(), "the engine core runs in a process of its own"
    assert _metric(server, "pagedllm:blocks_saved_total") == 0.0  # declared: the series exists from the start
    _complete(server, PROMPTS[0])
    assert _metric(server, "pagedllm:blocks_saved_total") == 2.0
    assert _metric(server, "pagedllm:last_finished_blocks") == 2.0
    _complete(server, PROMPTS[1])
    assert _metric(server, "pagedllm:blocks_saved_total") == 4.0
    assert _metric(server, "pagedllm:blocks_per_finished_request_count") == 2.0
    assert _metric(server, "pagedllm:blocks_per_finished_request_sum") == 4.0
    assert _metric(server, "pagedllm:prompt_tokens_total") == 40.0

    lines = [json.loads(line) for line in stats_path.read_text().splitlines()]
    [initialized] = [line for line in lines if line["event"] == "engine_initialized"]
    assert [spec[0] for spec in initialized["custom_metrics"]] == [
        "blocks_saved", "last_finished_blocks", "blocks_per_finished_request",
    ]
    figures = [
        line["scheduler"]["custom_stats"]
        for line in lines
        if line["event"] == "step" and line["scheduler"] and line["scheduler"].get("custom_stats")
    ]
    assert sum(f.get("blocks_saved", 0.0) for f in figures) == 4.0
    assert [obs for f in figures for obs in f.get("blocks_per_finished_request", [])] == [2.0, 2.0]
    finished = [(line["num_prompt_tokens"], line["num_generation_tokens"], line["finish_reason"])
                for line in lines if line["event"] == "finished"]
    assert finished == [(20, 4, "length"), (20, 4, "length")]
