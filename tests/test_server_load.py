"""The server under concurrent load, client disconnects, a dying engine core,
SIGTERM, and /metrics after known traffic."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from helpers.server import ServerProcess, is_alive, start_server, wait_until
from helpers.tiny_models import cached_tiny_model
from prometheus_client.parser import text_string_to_metric_families

MODEL_NAME = "tiny-load"
# NOTE: only guards against a hang; no test here measures how fast anything is.
HANG_GUARD_S = 60.0
MAX_MODEL_LEN = 2048
NUM_KV_BLOCKS = 128
# Far more than a test waits for: a request that long is only ever aborted.
LONG_MAX_TOKENS = MAX_MODEL_LEN - 16


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=13, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with start_server(model_dir, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--served-model-name", MODEL_NAME) as srv:
        yield srv


def scrape(server: ServerProcess) -> dict[str, float]:
    """Every sample of /metrics: 'name{label=value,...}' (model_name dropped) -> value."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "model_name"}
            assert sample.labels.get("model_name") == MODEL_NAME, sample
            key = sample.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}" if labels else "")
            samples[key] = sample.value
    return samples


def idle(server: ServerProcess) -> bool:
    metrics = scrape(server)
    return (metrics["pagedllm:num_requests_running"], metrics["pagedllm:num_requests_waiting"],
            metrics["pagedllm:kv_cache_usage_perc"]) == (0, 0, 0)


def test_32_concurrent_streaming_clients_complete_then_all_blocks_are_free(server: ServerProcess) -> None:
    num_clients, max_tokens = 32, 16

    async def one_client(client: openai.AsyncOpenAI, index: int) -> tuple[list[str | None], Any]:
        stream = await client.completions.create(
            model=MODEL_NAME, prompt=f"client {index}:", max_tokens=max_tokens, temperature=0.7, seed=index,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        finishes: list[str | None] = []
        usage = None
        async for chunk in stream:
            finishes.extend(c.finish_reason for c in chunk.choices if c.finish_reason)
            usage = chunk.usage or usage
        return finishes, usage

    async def run_all() -> list[tuple[list[str | None], Any]]:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=120) as client:
            return await asyncio.gather(*(one_client(client, i) for i in range(num_clients)))

    results = asyncio.run(run_all())
    assert [finishes for finishes, _ in results] == [["length"]] * num_clients
    assert [usage.completion_tokens for _, usage in results] == [max_tokens] * num_clients
    assert wait_until(lambda: idle(server), timeout_s=HANG_GUARD_S)


def test_client_dropping_mid_stream_is_aborted_and_its_blocks_freed_within_a_second(server: ServerProcess) -> None:
    before = scrape(server)["pagedllm:generation_tokens_total"]
    body = {"model": MODEL_NAME, "prompt": "a long story", "max_tokens": LONG_MAX_TOKENS, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            for _ in range(3):
                assert next(lines).startswith("data: {")
                next(lines)  # the blank line after each event
            running = scrape(server)
            assert running["pagedllm:num_requests_running"] == 1
            assert running["pagedllm:kv_cache_usage_perc"] > 0
    # Aborted, not run to its end (HANG_GUARD_S only guards against a hang).
    assert wait_until(lambda: idle(server), timeout_s=HANG_GUARD_S, interval_s=0.02)
    assert scrape(server)["pagedllm:generation_tokens_total"] - before < LONG_MAX_TOKENS


def test_non_streaming_client_disconnect_aborts_the_request(server: ServerProcess) -> None:
    before = scrape(server)["pagedllm:generation_tokens_total"]
    body = {"model": MODEL_NAME, "prompt": "another long story", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    assert wait_until(lambda: idle(server), timeout_s=HANG_GUARD_S, interval_s=0.02)
    assert scrape(server)["pagedllm:generation_tokens_total"] - before < LONG_MAX_TOKENS


HISTOGRAMS_ONE_PER_REQUEST = [
    "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
    "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
    "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens",
    "request_params_max_tokens", "request_params_n",
]


def test_metrics_count_known_traffic(server: ServerProcess) -> None:
    # Distinct prompts shorter than a block: no prefix-cache hit can change the counts.
    prompt_lengths, max_tokens = [3, 5, 7], [4, 5, 6]
    before = scrape(server)
    for index, (prompt_len, num_tokens) in enumerate(zip(prompt_lengths, max_tokens, strict=True)):
        prompt = list(range(1000 + 10 * index, 1000 + 10 * index + prompt_len))
        response = httpx.post(f"{server.base_url}/v1/completions", timeout=30, json={
            "model": MODEL_NAME, "prompt": prompt, "max_tokens": num_tokens, "ignore_eos": True, "temperature": 0,
        })
        assert response.json()["usage"]["completion_tokens"] == num_tokens
    assert wait_until(lambda: idle(server), timeout_s=HANG_GUARD_S)
    after = scrape(server)

    def delta(name: str) -> float:
        return after.get(f"pagedllm:{name}", 0.0) - before.get(f"pagedllm:{name}", 0.0)

    num_requests, num_prompt, num_generated = len(prompt_lengths), sum(prompt_lengths), sum(max_tokens)
    assert delta("prompt_tokens_total") == num_prompt
    assert delta("generation_tokens_total") == num_generated
    assert delta("request_success_total{finished_reason=length}") == num_requests
    assert delta("request_success_total{finished_reason=stop}") == 0
    for name in HISTOGRAMS_ONE_PER_REQUEST:
        assert delta(f"{name}_count") == num_requests, name
    assert delta("request_prompt_tokens_sum") == num_prompt
    assert delta("request_generation_tokens_sum") == num_generated
    assert delta("request_params_max_tokens_sum") == num_generated
    assert delta("request_params_n_sum") == num_requests
    # Every token after a request's first has one inter-token latency.
    assert delta("inter_token_latency_seconds_count") == num_generated - num_requests
    # One prefill step per request, then one decode step per further token.
    assert delta("iteration_tokens_total_count") == num_generated
    assert delta("iteration_tokens_total_sum") == num_prompt + num_generated - num_requests
    assert delta("prefix_cache_queries_total") == num_prompt
    assert delta("prefix_cache_hits_total") == 0
    assert delta("num_preemptions_total") == 0
    for gauge in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        assert after[f"pagedllm:{gauge}"] == 0
    assert any(key.startswith("pagedllm:cache_config_info") for key in after)


def test_sigterm_stops_server_and_engine_core_without_orphans(server: ServerProcess) -> None:
    engine_pid = httpx.get(f"{server.base_url}/server_info").json()["engine_pid"]
    descendants = server.descendants()
    assert engine_pid in descendants
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=HANG_GUARD_S) == 0  # drained, not killed by the signal
    assert wait_until(lambda: not any(is_alive(pid) for pid in descendants), timeout_s=HANG_GUARD_S)


# ------------------------------------------------------------ engine death


def test_killed_engine_core_makes_health_503_and_inflight_requests_fail_fast(model_dir: Path) -> None:
    # The stay-up policy; the default (exit 1) is in test_server_faults.py.
    with start_server(model_dir, "--num-kv-blocks", str(NUM_KV_BLOCKS), "--served-model-name", MODEL_NAME,
                      "--keep-alive-on-engine-death") as srv:
        url = srv.base_url
        body = {"model": MODEL_NAME, "prompt": "never finishes", "max_tokens": LONG_MAX_TOKENS, "ignore_eos": True}
        non_streaming: dict[str, Any] = {}

        def post_non_streaming() -> None:
            response = httpx.post(f"{url}/v1/completions", json=body, timeout=30)
            non_streaming.update(status=response.status_code, body=response.json(), at=time.monotonic())

        with httpx.Client(timeout=30) as client:
            with client.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: {")
                thread = threading.Thread(target=post_non_streaming)
                thread.start()
                assert wait_until(lambda: scrape(srv)["pagedllm:num_requests_running"] == 2, timeout_s=HANG_GUARD_S)
                engine_pid = client.get(f"{url}/server_info").json()["engine_pid"]
                descendants = srv.descendants()
                os.kill(engine_pid, signal.SIGKILL)
                killed_at = time.monotonic()
                events = [line for line in lines if line]
        thread.join(HANG_GUARD_S)
        assert not thread.is_alive()

        assert events[-1] == "data: [DONE]"
        error = json.loads(events[-2].removeprefix("data: "))["error"]
        assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
        assert non_streaming["status"] == 503 and non_streaming["at"] >= killed_at  # ended by the kill
        assert non_streaming["body"]["error"]["type"] == "ServiceUnavailableError"
        assert wait_until(lambda: httpx.get(f"{url}/health").status_code == 503, timeout_s=HANG_GUARD_S)
        refused = httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503
        time.sleep(0.5)  # a dead core does not end a server that is told to stay up
        assert srv.process.poll() is None and httpx.head(f"{url}/health").status_code == 503
        srv.process.send_signal(signal.SIGTERM)
        assert srv.process.wait(timeout=HANG_GUARD_S) == 0
        assert wait_until(lambda: not any(is_alive(pid) for pid in descendants), timeout_s=HANG_GUARD_S)
