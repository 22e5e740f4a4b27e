"""Faults of a real `pagedllm serve`: the engine core killed mid-stream or
stopped (SIGSTOP), SIGTERM with requests in flight, admission by sequences
(prompts x n) and aborts in the metrics.

The documented policies checked here (serve()'s docstring): a dead engine
core ends every request in flight with 503 (a stream: an error chunk, then
[DONE]) and the API process exits 1; SIGTERM turns new requests away with
503 (/health: `"status": "draining"`, on a connection it still accepts),
lets requests finish for `server.drain_timeout_s`, ends the rest with 503
and exits 0; no process is left behind either way.
"""

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
import pytest
from helpers.server import ServerProcess, is_alive, start_server, wait_until
from helpers.tiny_models import cached_tiny_model
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

MODEL_NAME = "tiny-faults"
# Long enough that a LONG request is still running when a test ends it.
MAX_MODEL_LEN = 8192
LONG_MAX_TOKENS = MAX_MODEL_LEN - 16
NUM_KV_BLOCKS = 2048
MAX_PENDING = 16
HEALTH_TIMEOUT_S = 1.0
DRAIN_TIMEOUT_S = 6.0
# Runs well past the SIGTERM (>= 0.2 s at 1 ms a step), well within the drain
# timeout (<= 2 s at the 10 ms a step of a loaded 2-core machine).
SHORT_MAX_TOKENS = 200
# NOTE: only guards against a hang; no test measures how fast anything is.
HANG_GUARD_S = 60.0
SERVER_ARGS = ("--num-kv-blocks", str(NUM_KV_BLOCKS), "--served-model-name", MODEL_NAME)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=13, max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with start_server(model_dir, *SERVER_ARGS, "--max-pending-requests", str(MAX_PENDING),
                      "--health-timeout-s", str(HEALTH_TIMEOUT_S)) as srv:
        yield srv


def metrics(server: ServerProcess) -> dict[str, float]:
    """'name{label=value}' (model_name dropped) -> value, of every /metrics sample."""
    samples = {}
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            samples[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return samples


def finishes(server: ServerProcess) -> dict[str, float]:
    found = metrics(server)
    return {reason: found[f"pagedllm:request_success_total{{finished_reason={reason}}}"]
            for reason in ("abort", "length", "stop")}


def num_in_engine(server: ServerProcess) -> float:
    found = metrics(server)
    return found["pagedllm:num_requests_running"] + found["pagedllm:num_requests_waiting"]


def completion(prompt: Any = "hello", max_tokens: int = LONG_MAX_TOKENS, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, **extra}


def error_of(event: str) -> dict[str, Any]:
    return json.loads(event.removeprefix("data: "))["error"]


class NonStreaming(threading.Thread):
    """A non-streaming POST in the background: its status, body and end time."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.status: int | None = None
        self.json: dict[str, Any] = {}
        self.ended_at = 0.0

    def run(self) -> None:
        response = httpx.post(self.url, json=self.body, timeout=120)
        self.status, self.json, self.ended_at = response.status_code, response.json(), time.monotonic()


def health_status(server: ServerProcess) -> int | str:
    try:
        return httpx.get(f"{server.base_url}/health", timeout=30).status_code
    except httpx.TransportError:
        return "refused"


def assert_no_orphans(pids: list[int]) -> None:
    assert pids
    assert wait_until(lambda: not any(is_alive(pid) for pid in pids), timeout_s=HANG_GUARD_S), [
        pid for pid in pids if is_alive(pid)
    ]


# ------------------------------------------------------------ engine faults


def test_killed_engine_core_ends_requests_with_503_and_the_api_process_exits_1(model_dir: Path) -> None:
    with start_server(model_dir, *SERVER_ARGS) as srv:
        url = f"{srv.base_url}/v1/completions"
        non_streaming = NonStreaming(url, completion("never finishes"))
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url, json=completion("nor this", stream=True)) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: {")
                non_streaming.start()
                assert wait_until(lambda: num_in_engine(srv) == 2, timeout_s=HANG_GUARD_S)
                engine_pid = client.get(f"{srv.base_url}/server_info").json()["engine_pid"]
                descendants = srv.descendants()
                assert engine_pid in descendants
                os.kill(engine_pid, signal.SIGKILL)
                killed_at = time.monotonic()
                events = [line for line in lines if line]
        # /health never says 200 once the core is gone (503 until the process is gone).
        assert health_status(srv) in (503, "refused")
        non_streaming.join(HANG_GUARD_S)

        assert events[-1] == "data: [DONE]"
        assert (error_of(events[-2])["code"], error_of(events[-2])["type"]) == (503, "ServiceUnavailableError")
        assert not non_streaming.is_alive()
        assert non_streaming.status == 503 and non_streaming.ended_at >= killed_at  # ended by the kill
        assert non_streaming.json["error"]["type"] == "ServiceUnavailableError"
        # The policy: exit non-zero (a supervisor restarts it), saying why.
        assert srv.process.wait(timeout=HANG_GUARD_S) == 1
        assert "keep_alive_on_engine_death" in srv.log()
        assert_no_orphans(descendants)


def test_stopped_engine_core_fails_health_within_its_timeout_then_recovers(server: ServerProcess) -> None:
    engine_pid = httpx.get(f"{server.base_url}/server_info").json()["engine_pid"]
    assert httpx.head(f"{server.base_url}/health").status_code == 200
    os.kill(engine_pid, signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        with httpx.Client(timeout=30) as client:
            while (response := client.get(f"{server.base_url}/health")).status_code == 200:
                assert time.monotonic() - stopped_at < HANG_GUARD_S
                time.sleep(0.05)
            failed_after = time.monotonic() - stopped_at
            head = client.head(f"{server.base_url}/health")
    finally:
        os.kill(engine_pid, signal.SIGCONT)
    assert response.status_code == 503
    error = response.json()["error"]
    assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
    assert "server.health_timeout_s" in error["message"]
    # Heard from just before the stop, so no sooner than one timeout.
    assert failed_after >= HEALTH_TIMEOUT_S - 0.05
    assert (head.status_code, head.content) == (503, b"")
    # Running again: healthy again, and it serves.
    assert wait_until(lambda: health_status(server) == 200, timeout_s=HANG_GUARD_S)
    head = httpx.head(f"{server.base_url}/health", timeout=30)
    assert (head.status_code, head.content) == (200, b"")
    response = httpx.post(f"{server.base_url}/v1/completions", json=completion(max_tokens=3), timeout=60)
    assert response.json()["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------- admission


def test_request_of_prompts_times_n_above_the_limit_is_refused_while_a_small_one_finishes(
    server: ServerProcess,
) -> None:
    url = f"{server.base_url}/v1/completions"
    # 5 prompts x n=4 = 20 sequences > 16: a 400 however idle the server is.
    too_big = completion(["a", "b", "c", "d", "e"], n=4)

    async def both() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(client.post(url, json=too_big),
                                        client.post(url, json=completion("small", max_tokens=4)))

    before = num_in_engine(server)
    refused, finished = asyncio.run(both())
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert (error["param"], error["type"]) == ("n", "BadRequestError")
    assert "5 prompt(s) x n=4 = 20 sequences" in error["message"]
    assert f"server.max_pending_requests = {MAX_PENDING}" in error["message"]
    assert finished.status_code == 200 and finished.json()["usage"]["completion_tokens"] == 4
    assert before == 0 and wait_until(lambda: num_in_engine(server) == 0, timeout_s=HANG_GUARD_S)


def test_pending_limit_counts_sequences_each_request_up_to_its_share(server: ServerProcess) -> None:
    url = f"{server.base_url}/v1/completions"
    with httpx.Client(timeout=60) as client:
        # One prompt with n=12 is 12 sequences, but one request counts for at
        # most half the limit (server.max_pending_share): 8 of the 16.
        with client.stream("POST", url, json=completion("held", n=12, stream=True)) as held, \
                client.stream("POST", url, json=completion(["p", "q"], n=3, stream=True)) as held_too:  # 8 + 6
            lines = held.iter_lines(), held_too.iter_lines()  # NOTE: kept: a dropped iterator closes the connection
            assert all(next(stream_lines).startswith("data: {") for stream_lines in lines)
            overloaded = client.post(url, json=completion(["x", "y"], n=3, max_tokens=4))
            assert overloaded.status_code == 503, overloaded.text
            message = overloaded.json()["error"]["message"]
            assert "14 unfinished sequences" in message and "adds 6" in message
            assert f"server.max_pending_requests) is {MAX_PENDING}" in message
            fits = client.post(url, json=completion(["x", "y"], max_tokens=4))  # 14 + 2 = 16
            assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] == 8
            # None of the refused request's prompts reached the engine.
            assert wait_until(lambda: num_in_engine(server) == 18, timeout_s=HANG_GUARD_S)
    assert wait_until(lambda: num_in_engine(server) == 0, timeout_s=HANG_GUARD_S)


# ------------------------------------------------------------------ metrics


def test_client_disconnects_are_counted_once_per_sample_as_abort(server: ServerProcess) -> None:
    url = f"{server.base_url}/v1/completions"
    before = finishes(server)
    with httpx.Client(timeout=60) as client:
        with client.stream("POST", url, json=completion("dropped", n=2, stream=True)) as stream:
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")
            assert wait_until(lambda: num_in_engine(server) == 2, timeout_s=HANG_GUARD_S)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=completion("dropped too"), timeout=httpx.Timeout(60, read=0.5))
    expected = {"abort": before["abort"] + 3, "length": before["length"], "stop": before["stop"]}
    assert wait_until(lambda: finishes(server) == expected, timeout_s=HANG_GUARD_S), finishes(server)
    # A request that ends by its stop string is a "stop", not an abort.
    text = httpx.post(url, json=completion("x", max_tokens=8, temperature=0), timeout=60).json()["choices"][0]["text"]
    stop = text.strip()[:2]
    assert stop
    stopped = httpx.post(url, json=completion("x", max_tokens=8, temperature=0, stop=[stop]), timeout=60).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    expected = {"abort": before["abort"] + 3, "length": before["length"] + 1, "stop": before["stop"] + 1}
    assert finishes(server) == expected


# ----------------------------------------------------------------- shutdown


def test_sigterm_drains_short_requests_with_health_draining_then_ends_long_ones_with_503_and_exits_0(
    model_dir: Path,
) -> None:
    with start_server(model_dir, *SERVER_ARGS, "--drain-timeout-s", str(DRAIN_TIMEOUT_S)) as srv:
        url = f"{srv.base_url}/v1/completions"
        long_non_streaming = NonStreaming(url, completion("long, not streamed"))
        short = NonStreaming(url, completion("short", max_tokens=SHORT_MAX_TOKENS))
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", url, json=completion("long, streamed", stream=True)) as stream:
                lines = stream.iter_lines()
                assert next(lines).startswith("data: {")
                long_non_streaming.start()
                assert wait_until(lambda: num_in_engine(srv) == 2, timeout_s=HANG_GUARD_S)
                short.start()
                assert wait_until(lambda: num_in_engine(srv) == 3, timeout_s=HANG_GUARD_S)
                descendants = srv.descendants()
                srv.process.send_signal(signal.SIGTERM)
                signalled_at = time.monotonic()
                # While the old requests drain, /health answers on a new connection: 503, draining.
                assert wait_until(lambda: health_status(srv) == 503, timeout_s=HANG_GUARD_S)
                health = httpx.get(f"{srv.base_url}/health", timeout=30)
                assert (health.status_code, health.json()["status"]) == (503, "draining")
                assert (health.json()["error"]["code"], health.headers["connection"]) == (503, "close")
                assert httpx.head(f"{srv.base_url}/health", timeout=30).status_code == 503
                # A new request is turned away at once, with the reason.
                refused = httpx.post(url, json=completion("too late", max_tokens=2), timeout=30)
                assert refused.status_code == 503 and "draining" in refused.json()["error"]["message"]
                assert srv.process.poll() is None
                events = [line for line in lines if line]
                stream_ended_at = time.monotonic()
        short.join(HANG_GUARD_S)
        long_non_streaming.join(HANG_GUARD_S)

        # The short one was still running at SIGTERM and finished normally.
        assert short.status == 200, short.json
        assert short.ended_at > signalled_at
        assert short.json["choices"][0]["finish_reason"] == "length"
        assert short.json["usage"]["completion_tokens"] == SHORT_MAX_TOKENS
        # The long ones ended after the drain timeout with the shutdown's 503.
        assert events[-1] == "data: [DONE]"
        error = error_of(events[-2])
        assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
        assert "shutting down" in error["message"]
        assert stream_ended_at - signalled_at >= DRAIN_TIMEOUT_S - 0.1
        assert long_non_streaming.status == 503
        assert long_non_streaming.json["error"]["type"] == "ServiceUnavailableError"
        assert "shutting down" in long_non_streaming.json["error"]["message"]
        assert long_non_streaming.ended_at - signalled_at >= DRAIN_TIMEOUT_S - 0.1
        assert srv.process.wait(timeout=HANG_GUARD_S) == 0
        assert_no_orphans(descendants)

