"""`pagedllm disagg-proxy` in front of two `pagedllm serve` instances that
share a shared_storage directory: disaggregated prefill on one machine."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers.server import start_cli_server, start_server

from pagedllm.entrypoints.disagg_proxy import build_app, prefill_body

CHAT = {
    "model": "pagedllm-tiny",
    "messages": [{"role": "user", "content": "Write a Python function that reads a file and returns its lines. " * 3}],
    "max_tokens": 12,
    "temperature": 0,
}


def _kv_flags(path: Path, role: str) -> list[str]:
    return ["--num-kv-blocks", "64", "--dtype", "float32", "--kv-connector", "shared_storage", "--kv-role", role,
            "--kv-connector-extra-config", json.dumps({"path": str(path)})]


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_prefill_body_asks_for_one_token_without_streaming() -> None:
    body = {"prompt": "x", "max_tokens": 50, "max_completion_tokens": 50, "stream": True,
            "stream_options": {"include_usage": True}, "n": 2, "temperature": 0.3}
    assert prefill_body(body) == {"prompt": "x", "max_tokens": 1, "stream": False, "n": 1, "temperature": 0.3}


def test_a_body_not_sent_as_json_is_refused_before_any_server_sees_it() -> None:
    import asyncio

    # Unreachable servers: a forwarded request would be a 502, not a 415.
    app = build_app("http://127.0.0.1:9", "http://127.0.0.1:9")

    async def post(content_type: str) -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
            return await client.post("/v1/chat/completions", content=json.dumps(CHAT).encode(),
                                     headers={"content-type": content_type})

    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        response = asyncio.run(post(content_type))
        assert response.status_code == 415, (content_type, response.text)
        assert response.json()["error"]["param"] == "content-type"


@pytest.mark.slow
def test_proxy_serves_a_chat_completion_through_prefill_then_decode(tmp_path: Path) -> None:
    with start_server(None, "--num-kv-blocks", "64", "--dtype", "float32") as plain:
        expected = httpx.post(f"{plain.base_url}/v1/chat/completions", json=CHAT, timeout=60).json()
    with (
        start_server(None, *_kv_flags(tmp_path, "producer")) as prefill,
        start_server(None, *_kv_flags(tmp_path, "consumer")) as decode,
        start_cli_server(["disagg-proxy", "--prefill", prefill.base_url, "--decode", decode.base_url]) as proxy,
    ):
        response = httpx.post(f"{proxy.base_url}/v1/chat/completions", json=CHAT, timeout=60)
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] == 12
        # The prompt's full blocks came from the producer's files.
        assert list(tmp_path.rglob("*.safetensors"))
        metrics = httpx.get(f"{decode.base_url}/metrics", timeout=10).text
        prompt_tokens = body["usage"]["prompt_tokens"]
        assert _metric(metrics, "pagedllm:external_prefix_cache_hits_total") == (prompt_tokens - 1) // 16 * 16
        # Streaming goes through too, and a bad request is the prefill server's 400.
        with httpx.stream("POST", f"{proxy.base_url}/v1/chat/completions", json={**CHAT, "stream": True},
                          timeout=60) as stream:
            chunks = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert chunks[-1] == "data: [DONE]" and len(chunks) > 3
        bad = httpx.post(f"{proxy.base_url}/v1/chat/completions", json={**CHAT, "temperature": -1}, timeout=30)
        assert bad.status_code == 400 and "temperature" in bad.text
        assert httpx.get(f"{proxy.base_url}/health", timeout=10).status_code == 200
