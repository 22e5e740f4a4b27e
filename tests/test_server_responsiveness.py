"""Nothing heavy on the API event loop: /health and /metrics stay fast while
another client sends a maximal prompt, a maximal schema or a chat template;
request templates are refused unless trusted and time-limited when trusted;
memory goes back to the OS after an oversized request.

The helpers (time-limited rendering, tokenizing without a full Encoding, the
worker pool) are checked directly first, against transformers as reference.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.server import ServerProcess, start_server, wait_until
from helpers.tiny_models import cached_tiny_model

from pagedllm.core.errors import InvalidRequestError
from pagedllm.entrypoints.openai.chat_template import (
    RENDERER_ARGUMENTS,
    check_chat_template_kwargs,
    render_chat_template,
)
from pagedllm.entrypoints.openai.fast_tokenizer import decode_tokens, encode_text
from pagedllm.entrypoints.openai.request_pool import RequestWorkerPool

# Small enough for a fast test, large enough that the old code (everything on
# the event loop) stalled /health measurably: a 1 MiB prompt blocked it for
# ~1.5 s here, a 3.9 MB one for 6.5 s; a request template with a long loop
# for as long as the loop ran.
MAX_BODY_BYTES = 1 << 20
POLL_INTERVAL_S = 0.020
TEMPLATE_TIMEOUT_S = 1.0
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi"}]
# Nested loops: 10**10 iterations, far beyond any time limit.
ENDLESS_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x"
# A template of our own, with a variable that only chat_template_kwargs sets.
CUSTOM_TEMPLATE = "{% for m in messages %}<{{ m.role }}|{{ flavour }}>{{ m.content }}{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(get_tokenizer_dir()))


def render(tokenizer: Any, chat_template: str | None = None, **overrides: Any) -> str:
    kwargs: dict[str, Any] = dict(
        chat_template=chat_template, add_generation_prompt=True, template_kwargs=None, timeout_s=5.0,
        max_chars=1 << 20,
    )
    return render_chat_template(tokenizer, MESSAGES, **{**kwargs, **overrides})


# ------------------------------------------------------ time-limited render


def test_guarded_render_equals_transformers_render(tokenizer: Any) -> None:
    reference = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert render(tokenizer) == reference
    assert render(tokenizer, CUSTOM_TEMPLATE, template_kwargs={"flavour": "mint"}) == (
        "<system|mint>You are terse.<user|mint>Say hi"
    )


def test_endless_template_is_stopped_at_its_time_limit_and_the_tracer_restored(tokenizer: Any) -> None:
    def previous_tracer(frame: Any, event: str, arg: Any) -> None:
        return None

    sys.settrace(previous_tracer)
    try:
        started = time.monotonic()
        with pytest.raises(InvalidRequestError) as caught:
            render(tokenizer, ENDLESS_TEMPLATE, timeout_s=0.3)
        elapsed = time.monotonic() - started
        assert sys.gettrace() is previous_tracer
    finally:
        sys.settrace(None)
    assert caught.value.field == "chat_template"
    assert "server.chat_template_timeout_s = 0.3 s" in str(caught.value)
    assert elapsed >= 0.3  # it returned: stopped at its limit, not run to the end


def test_template_that_manufactures_text_is_stopped_at_the_output_bound(tokenizer: Any) -> None:
    flood = "{% for i in range(100000) %}{{ 'a' * 100000 }}{% endfor %}"  # 10 GB if rendered
    macro_flood = "{% macro m() %}{% for i in range(10000) %}{{ 'a' * 1000 }}{% endfor %}{% endmacro %}{{ m() }}"
    for template in (flood, macro_flood):
        with pytest.raises(InvalidRequestError) as caught:
            render(tokenizer, template, max_chars=100_000)
        assert caught.value.field == "chat_template"
        assert "rendered more than 100000 characters" in str(caught.value)
    # Exactly at the bound is fine.
    assert render(tokenizer, "{{ 'b' * 1000 }}", max_chars=1000) == "b" * 1000


def test_model_template_past_the_limit_names_messages(tokenizer: Any) -> None:
    with pytest.raises(InvalidRequestError) as caught:
        render(tokenizer, max_chars=10)
    assert caught.value.field == "messages"


def test_template_kwargs_may_not_override_renderer_arguments() -> None:
    from transformers import PreTrainedTokenizerBase

    # A transformers upgrade that adds a renderer argument must be listed too.
    own = set(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"self", "kwargs"}
    assert own <= RENDERER_ARGUMENTS
    check_chat_template_kwargs({"flavour": "mint", "enable_thinking": False})
    for key in ("tokenize", "messages", "chat_template", "add_generation_prompt", "conversation"):
        with pytest.raises(InvalidRequestError) as caught:
            check_chat_template_kwargs({"flavour": 1, key: True})
        assert caught.value.field == f"chat_template_kwargs.{key}"


# --------------------------------------------------- tokenizing off the loop


TEXTS = ["def add(a, b):", "", "  leading spaces\n\ttabs", "héllo wörld — ünïcode 日本語 🙂",
         "<|im_start|>user\nhi<|im_end|>", "x" * 5000]


def test_encode_and_decode_helpers_equal_the_tokenizer(tokenizer: Any) -> None:
    for text in TEXTS:
        for add_special_tokens in (True, False):
            assert encode_text(tokenizer, text, add_special_tokens) == tokenizer.encode(
                text, add_special_tokens=add_special_tokens
            )
        token_ids = tokenizer.encode(text)
        assert decode_tokens(tokenizer, token_ids) == tokenizer.decode(token_ids)
    random_ids = random.Random(0).choices(range(len(tokenizer)), k=300)
    assert decode_tokens(tokenizer, random_ids) == tokenizer.decode(random_ids)


def test_encode_refuses_a_text_longer_than_the_limit_with_its_token_count(tokenizer: Any) -> None:
    text = "hello world " * 50
    num_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert encode_text(tokenizer, text, False, max_num_tokens=num_tokens) == tokenizer.encode(
        text, add_special_tokens=False
    )
    with pytest.raises(InvalidRequestError) as caught:
        encode_text(tokenizer, text, False, max_num_tokens=num_tokens - 1)
    assert (caught.value.field, caught.value.value) == ("prompt", f"<{num_tokens} tokens>")
    assert f"max_model_len is {num_tokens}" in str(caught.value)


def test_pool_runs_at_most_its_threads_at_once_and_skips_cancelled_waiters() -> None:
    pool = RequestWorkerPool(num_threads=2)
    lock = threading.Lock()
    running = [0]
    peak = [0]
    ran: list[int] = []

    def job(index: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        with lock:
            running[0] -= 1
            ran.append(index)
        return index * 10

    async def main() -> list[int]:
        tasks = [asyncio.ensure_future(pool.run(job, index)) for index in range(6)]
        await asyncio.sleep(0.01)
        assert pool.num_waiting == 4
        tasks[5].cancel()  # its client left while it waited: it never runs
        results = await asyncio.gather(*tasks[:5])
        await asyncio.gather(tasks[5], return_exceptions=True)
        return results

    try:
        assert asyncio.run(main()) == [0, 10, 20, 30, 40]
    finally:
        pool.shutdown()
    assert peak[0] == 2
    assert sorted(ran) == [0, 1, 2, 3, 4]


# ------------------------------------------------------------ live servers


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return cached_tiny_model("llama", with_tokenizer=True, seed=11)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[ServerProcess]:
    with start_server(model_dir, "--num-kv-blocks", "64", "--max-body-bytes", str(MAX_BODY_BYTES)) as srv:
        yield srv


@pytest.fixture(scope="module")
def trusted_server(model_dir: Path) -> Iterator[ServerProcess]:
    # The default body limit (4 MiB): the RSS test sends a 3.9 MB prompt.
    with start_server(
        model_dir, "--num-kv-blocks", "64", "--trust-request-chat-template",
        "--chat-template-timeout-s", str(TEMPLATE_TIMEOUT_S),
    ) as srv:
        yield srv


class LatencyProbe:
    """Polls /health and /metrics (alternately, every POLL_INTERVAL_S) on its
    own connection while the heavy request runs; records each latency."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.latencies: dict[str, list[float]] = {"/health": [], "/metrics": []}
        self._stop = threading.Event()
        self.heavy_s = 0.0
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            paths = ["/health", "/metrics"]
            index = 0
            while not self._stop.is_set():
                path = paths[index % 2]
                started = time.perf_counter()
                assert client.get(path).status_code == 200
                self.latencies[path].append(time.perf_counter() - started)
                index += 1
                self._stop.wait(POLL_INTERVAL_S)

    def during(self, heavy: Callable[[], httpx.Response]) -> httpx.Response:
        self._thread.start()
        time.sleep(0.1)  # warm connection
        for samples in self.latencies.values():
            samples.clear()
        started = time.perf_counter()
        try:
            return heavy()
        finally:
            self.heavy_s = time.perf_counter() - started
            self._stop.set()
            self._thread.join()

    def check(self, min_samples: int) -> None:
        # NOTE: no absolute bound (a loaded machine is slow everywhere): health was
        # answered all through the heavy request, so no answer waited out most of it.
        # On the event loop (the old code) one answer waited for the whole request.
        for path, samples in self.latencies.items():
            assert max(samples) < self.heavy_s / 2, (path, sorted(samples)[-3:], self.heavy_s)
            # Enough samples that the heavy request was really polled through.
            assert len(samples) >= min_samples, (path, len(samples))


def post_json(url: str, body: dict[str, Any]) -> httpx.Response:
    # Encoded up front: the probe thread must not wait for this one's GIL.
    content = json.dumps(body).encode()
    return httpx.post(url, content=content, headers={"content-type": "application/json"}, timeout=120)


def long_prompt(num_chars: int) -> str:
    # Characters JSON does not escape: the body is the prompt plus a few bytes.
    words = ["hello", "world", "def", "foo(", "x = 1", "lorem", "ipsum", "a.b"]
    rng = random.Random(0)
    return " ".join(rng.choice(words) for _ in range(num_chars // 4))[:num_chars]


@pytest.mark.slow
def test_health_stays_fast_during_a_maximal_prompt(server: ServerProcess, tokenizer: Any) -> None:
    prompt = long_prompt(MAX_BODY_BYTES - 200)
    probe = LatencyProbe(server.base_url)
    response = probe.during(lambda: post_json(f"{server.base_url}/v1/completions",
                                              {"prompt": prompt, "max_tokens": 1}))
    num_tokens = len(tokenizer.encode(prompt))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt"
    assert f"the prompt has {num_tokens} tokens but max_model_len is 512" in error["message"]
    probe.check(min_samples=4)


@pytest.mark.slow
def test_health_stays_fast_during_a_maximal_token_id_prompt(trusted_server: ServerProcess) -> None:
    # ~3.9 MB of token ids (the default body limit): FastAPI's own parsing and
    # validation of them on the event loop stalled /health for about 0.4 s.
    token_ids = [1000 + index % 7000 for index in range(650_000)]
    probe = LatencyProbe(trusted_server.base_url)
    response = probe.during(lambda: post_json(f"{trusted_server.base_url}/v1/completions",
                                              {"prompt": token_ids, "max_tokens": 1}))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "650000" in error["message"], error
    # Parsed off the loop in about 0.1 s: a couple of polls fall inside it.
    probe.check(min_samples=2)


def maximal_schema(num_bytes: int) -> dict[str, Any]:
    """An object schema of `num_bytes` of boolean properties: as large as the
    server takes, yet quick to compile (string and enum properties of that
    size take the engine core's compile past its time limit)."""
    properties: dict[str, Any] = {}
    while len(json.dumps(properties)) < num_bytes - 200:
        properties[f"field_{len(properties):05d}"] = {"type": "boolean"}
    return {"type": "object", "properties": properties, "required": list(properties)[:50],
            "additionalProperties": False}


@pytest.mark.slow
def test_health_stays_fast_during_a_maximal_schema_and_a_refused_template(server: ServerProcess) -> None:
    # 100 KB: under the default structured_output.max_spec_bytes (128 KiB).
    schema = maximal_schema(100_000)
    body = {"messages": MESSAGES, "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}}
    probe = LatencyProbe(server.base_url)
    response = probe.during(lambda: post_json(f"{server.base_url}/v1/chat/completions", body))
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 1
    probe.check(min_samples=2)

    refused = post_json(f"{server.base_url}/v1/chat/completions",
                        {"messages": MESSAGES, "chat_template": ENDLESS_TEMPLATE, "max_tokens": 1})
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "chat_template"
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]


@pytest.mark.slow
def test_trusted_endless_template_is_stopped_while_health_stays_fast(trusted_server: ServerProcess) -> None:
    probe = LatencyProbe(trusted_server.base_url)
    started = time.monotonic()
    response = probe.during(lambda: post_json(
        f"{trusted_server.base_url}/v1/chat/completions",
        {"messages": MESSAGES, "chat_template": ENDLESS_TEMPLATE, "max_tokens": 1},
    ))
    elapsed = time.monotonic() - started
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template"
    assert f"server.chat_template_timeout_s = {TEMPLATE_TIMEOUT_S} s" in error["message"]
    assert elapsed >= TEMPLATE_TIMEOUT_S
    probe.check(min_samples=10)
    # The server is still whole: a normal chat request right after.
    normal = post_json(f"{trusted_server.base_url}/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert normal.status_code == 200


@pytest.mark.slow
def test_trusted_request_template_and_kwargs_are_applied(trusted_server: ServerProcess, tokenizer: Any) -> None:
    url = trusted_server.base_url
    expected_text = "<system|mint>You are terse.<user|mint>Say hi"
    expected = tokenizer.encode(expected_text, add_special_tokens=False)
    tokens = post_json(f"{url}/tokenize", {"messages": MESSAGES, "chat_template": CUSTOM_TEMPLATE,
                                            "chat_template_kwargs": {"flavour": "mint"}})
    assert tokens.status_code == 200, tokens.text
    assert tokens.json()["tokens"] == expected
    chat = post_json(f"{url}/v1/chat/completions", {
        "messages": MESSAGES, "chat_template": CUSTOM_TEMPLATE, "chat_template_kwargs": {"flavour": "mint"},
        "max_tokens": 1, "temperature": 0,
    })
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(expected)
    clash = post_json(f"{url}/v1/chat/completions", {
        "messages": MESSAGES, "chat_template_kwargs": {"tokenize": True}, "max_tokens": 1,
    })
    assert clash.status_code == 400
    assert clash.json()["error"]["param"] == "chat_template_kwargs.tokenize"


def api_rss_mb(server: ServerProcess) -> float:
    api_pid = httpx.get(f"{server.base_url}/server_info").json()["api_pid"]
    with open(f"/proc/{api_pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.slow
def test_memory_goes_back_after_an_oversized_prompt(trusted_server: ServerProcess) -> None:
    url = trusted_server.base_url
    post_json(f"{url}/v1/completions", {"prompt": "warm up", "max_tokens": 1})
    baseline = api_rss_mb(trusted_server)
    # Without malloc_trim the API process stayed ~250-300 MB larger after this.
    response = post_json(f"{url}/v1/completions", {"prompt": long_prompt(3_900_000), "max_tokens": 1})
    assert response.status_code == 400
    peak = api_rss_mb(trusted_server)
    assert wait_until(lambda: api_rss_mb(trusted_server) < baseline + 80, timeout_s=60), (
        baseline, peak, api_rss_mb(trusted_server)
    )
