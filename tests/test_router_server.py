"""`pagedllm router` over two `pagedllm serve` processes (issue 16), all on
127.0.0.1: completions (streamed or not) and chat come back as a backend
answers them directly; each family's repeats go to the backend that cached
its prefix (the router's predicted hit tokens equal the backends' reported
`cached_tokens`); the router's key and the backends' key are separate; a
backend killed mid-run fails the request it was serving with a clear error,
requests not yet started go to the other one, and /health says degraded.

The tests share the two backends and the router and run in file order (the
last one kills a backend)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from helpers.server import ServerProcess, start_cli_server, start_server, wait_until

pytestmark = pytest.mark.slow

BACKEND_KEY = "backend-secret"
ROUTER_KEY = "router-secret"
BLOCK = 16


@pytest.fixture(scope="module")
def backends() -> Iterator[list[ServerProcess]]:
    args = ("--dtype", "float32", "--num-kv-blocks", "128", "--enable-kv-events")
    with start_server("tiny", *args, api_key=BACKEND_KEY) as first, start_server("tiny", *args,
                                                                                  api_key=BACKEND_KEY) as second:
        yield [first, second]


@pytest.fixture(scope="module")
def router(backends: list[ServerProcess]) -> Iterator[ServerProcess]:
    command = ["router", "--backend", backends[0].base_url, "--backend", backends[1].base_url,
               "--api-key", ROUTER_KEY, "--backend-api-key", BACKEND_KEY]
    with start_cli_server(command, api_key=ROUTER_KEY) as server:
        yield server


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, headers=server.headers, timeout=60.0)


def _metric(text: str, name: str, backend: str | None = None) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and (backend is None or f'backend="{backend}"' in line))


def _metrics(router: ServerProcess) -> str:
    return httpx.get(router.base_url + "/metrics", headers=router.headers).text


COMPLETION = {"model": "pagedllm-tiny", "prompt": "The quick brown fox", "max_tokens": 8, "temperature": 0.0,
              "ignore_eos": True}
CHAT = {"model": "pagedllm-tiny", "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 8,
        "temperature": 0.0}


def test_completions_and_chat_through_the_router_equal_a_backends_answers(
    router: ServerProcess, backends: list[ServerProcess]
) -> None:
    direct = _post(backends[0], "/v1/completions", COMPLETION).json()["choices"][0]["text"]
    assert _post(router, "/v1/completions", COMPLETION).json()["choices"][0]["text"] == direct
    chat_direct = _post(backends[1], "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["content"]
    assert _post(router, "/v1/chat/completions", CHAT).json()["choices"][0]["message"]["content"] == chat_direct

    with httpx.stream("POST", router.base_url + "/v1/completions", json={**COMPLETION, "stream": True},
                      headers=router.headers, timeout=60.0) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    assert "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]) == direct


def test_the_router_has_its_own_key_and_sends_the_backends_key(router: ServerProcess) -> None:
    assert httpx.post(router.base_url + "/v1/completions", json=COMPLETION, timeout=60.0).status_code == 401
    wrong = {"Authorization": f"Bearer {BACKEND_KEY}"}
    assert httpx.post(router.base_url + "/v1/completions", json=COMPLETION, headers=wrong,
                      timeout=60.0).status_code == 401
    assert httpx.get(router.base_url + "/health").status_code == 200  # open, as on a backend
    models = httpx.get(router.base_url + "/v1/models", headers=router.headers).json()
    assert models["data"][0]["id"] == "pagedllm-tiny"


def test_each_familys_repeats_go_to_the_backend_that_cached_it(router: ServerProcess) -> None:
    rng = random.Random(9)
    families = [[rng.randrange(10, 4000) for _ in range(3 * BLOCK)] for _ in range(4)]
    workload = [family + [40 + repeat] for family in families for repeat in range(3)]
    rng.shuffle(workload)
    before = _metrics(router)
    cached = []
    for prompt in workload:  # one at a time: each decision sees the previous request's blocks
        body = {**COMPLETION, "prompt": prompt, "max_tokens": 2, "cache_salt": "tenant-a"}
        cached.append(_post(router, "/v1/completions", body).json()["usage"]["prompt_tokens_details"]
                      ["cached_tokens"])
    after = _metrics(router)

    def grew(name: str) -> float:
        return _metric(after, name) - _metric(before, name)

    assert sorted(cached) == [0] * 4 + [3 * BLOCK] * 8  # every repeat hit its family's whole prefix
    assert grew("pagedllm:router_prefix_routed_requests_total") == 8
    assert grew("pagedllm:router_predicted_hit_tokens_total") == grew("pagedllm:router_actual_hit_tokens_total")
    assert grew("pagedllm:router_actual_hit_tokens_total") == 8 * 3 * BLOCK
    # The same prompts under another salt are other blocks: nothing cached, nothing predicted.
    salted = _post(router, "/v1/completions", {**COMPLETION, "prompt": workload[0], "max_tokens": 2,
                                              "cache_salt": "tenant-b"}).json()
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_killed_backend_fails_only_the_request_it_served(
    router: ServerProcess, backends: list[ServerProcess]
) -> None:
    metrics = _metrics(router)
    served = [_metric(metrics, "pagedllm:router_requests_total", backend.base_url) for backend in backends]
    # The next new prompt goes to the backend that has served fewer (least loaded, then fewest routed).
    victim, survivor = (backends[0], backends[1]) if served[0] <= served[1] else (backends[1], backends[0])

    async def long_request_then_kill() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60.0) as client:
            body = {**COMPLETION, "prompt": "A long story", "max_tokens": 1500}
            pending = asyncio.ensure_future(client.post(router.base_url + "/v1/completions", json=body,
                                                        headers=router.headers))
            await asyncio.sleep(1.5)
            os.kill(victim.pid, signal.SIGKILL)
            return await pending

    failed = asyncio.run(long_request_then_kill())
    assert failed.status_code == 502, failed.text
    assert f"backend {victim.base_url} failed while serving the request" in failed.json()["error"]["message"]
    # Requests that had not started: all answered, by the survivor.
    for index in range(4):
        response = _post(router, "/v1/completions", {**COMPLETION, "prompt": f"after the crash {index}"})
        assert response.status_code == 200, response.text
    assert wait_until(lambda: httpx.get(router.base_url + "/health").status_code == 200, 5.0)
    health = httpx.get(router.base_url + "/health").json()
    assert health["status"] == "degraded"
    assert {b["backend"]: b["alive"] for b in health["backends"]} == {victim.base_url: False,
                                                                      survivor.base_url: True}
    assert _metric(_metrics(router), "pagedllm:router_backend_healthy", victim.base_url) == 0
