"""The HTTP boundary of `pagedllm serve`: a large non-streaming response is
built off the event loop (/health stays fast) and bounded before generation;
JSON routes take only JSON bodies (415); an error quotes a bounded part of a
client's value; HEAD answers on every GET route; a body that never arrives
is answered 408 and its connection closed.

The response encoders are checked first against pydantic's own dump, and
the size estimate against the JSON of a worst-case choice. The live tests
run the real app over uvicorn in front of an engine stand-in
(helpers/fake_engine.py) that answers at once, so a 50 MB response costs
only its HTTP side.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from helpers.fake_engine import TOKEN_ID
from helpers.server import ServerProcess, _wait_for_health, free_port, stop_server

from pagedllm.core.config import ServerConfig
from pagedllm.core.errors import InvalidRequestError
from pagedllm.entrypoints.openai.errors import (
    MAX_ECHO_CHARS,
    MAX_MESSAGE_CHARS,
    echo,
    error_body,
    invalid_request_message,
)
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionLogprob,
    ChatCompletionLogProbs,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionTopLogprob,
    ChatResponseMessage,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    UsageInfo,
)
from pagedllm.entrypoints.openai.request_body import json_content_type_problem
from pagedllm.entrypoints.openai.request_pool import RequestWorkerPool
from pagedllm.entrypoints.openai.response_body import (
    SLICE_ITEMS,
    JSONFragmentsResponse,
    encode_each,
    encode_in_pool,
    encode_model,
    stop_when,
)
from pagedllm.entrypoints.openai.response_size import (
    CHOICE_BYTES,
    chat_token_bytes,
    completion_token_bytes,
    max_token_json_bytes,
)
from pagedllm.entrypoints.openai.serving_chat import _encode_choice as encode_chat_choice
from pagedllm.entrypoints.openai.serving_completion import _encode_choice as encode_completion_choice

BODY_READ_TIMEOUT_S = 1.0
MAX_RESPONSE_BYTES = 256 << 20  # the default
JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from pagedllm.model_registry.tiny import get_tokenizer_dir

    return AutoTokenizer.from_pretrained(str(get_tokenizer_dir()))


# ------------------------------------------------------------ the encoders


def completion_choice(index: int, num_tokens: int, text: str = "tok") -> CompletionResponseChoice:
    logprobs = CompletionLogProbs(
        text_offset=list(range(num_tokens)), token_logprobs=[-0.5 - i / 7 for i in range(num_tokens)],
        tokens=[f"{text}{i}" for i in range(num_tokens)],
        top_logprobs=[{f"{text}{i}": -0.5, "\"quoted\"\n": -1e-05} for i in range(num_tokens)],
    )
    return CompletionResponseChoice(index=index, text="héllo \"there\"\n" * 3, logprobs=logprobs,
                                    finish_reason="length")


def chat_choice(index: int, num_tokens: int) -> ChatCompletionResponseChoice:
    top = [ChatCompletionTopLogprob(token="ü", logprob=-2.25, bytes=[195, 188])]
    content = [ChatCompletionLogprob(token=f"t{i}", logprob=-1.0 / (i + 1), bytes=list(f"t{i}".encode()),
                                     top_logprobs=top) for i in range(num_tokens)]
    return ChatCompletionResponseChoice(index=index, message=ChatResponseMessage(content="hi"),
                                        logprobs=ChatCompletionLogProbs(content=content), finish_reason="stop")


def test_fragments_parse_to_exactly_the_models_dump() -> None:
    usage = UsageInfo(prompt_tokens=3, completion_tokens=4, total_tokens=7)
    # Lists longer than a slice, shorter, empty; a choice without logprobs.
    completion_choices = [completion_choice(0, 2 * SLICE_ITEMS + 3), completion_choice(1, 5),
                          completion_choice(2, 0), CompletionResponseChoice(index=3, text="x")]
    chat_choices = [chat_choice(0, SLICE_ITEMS + 1), chat_choice(1, 0),
                    ChatCompletionResponseChoice(index=2, message=ChatResponseMessage(content=None))]
    for response, encode_choice in (
        (CompletionResponse(id="cmpl-1", model="m", choices=completion_choices, usage=usage),
         encode_completion_choice),
        (ChatCompletionResponse(id="chat-1", model="m", choices=chat_choices, usage=usage), encode_chat_choice),
    ):
        out: list[bytes] = []
        envelope = response.model_copy(update={"choices": []})

        def encode_choices(
            _: Any, out: list[bytes], choices: Any = response.choices, encode: Any = encode_choice
        ) -> None:
            encode_each(iter(choices), out, encode)

        encode_model(envelope, out, {"choices": encode_choices})
        assert json.loads(b"".join(out)) == json.loads(response.model_dump_json())
        # The large lists really were cut: no fragment holds a whole choice.
        assert len(out) > 4 * len(response.choices)


def test_fragments_response_sends_its_body_with_its_length() -> None:
    fragments = [b'{"a":', b"[" + b"1," * 400_000 + b"1]", b',"b":"', b"x" * (3 << 20), b'"}']
    expected = b"".join(fragments)
    messages: list[dict[str, Any]] = []

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    async def receive() -> dict[str, Any]:
        return {"type": "http.disconnect"}

    asyncio.run(JSONFragmentsResponse(list(fragments))({"type": "http"}, receive, send))
    start, *bodies = messages
    assert dict(start["headers"])[b"content-length"] == str(len(expected)).encode()
    assert dict(start["headers"])[b"content-type"] == b"application/json"
    assert b"".join(body["body"] for body in bodies) == expected
    # The small fragments in one write, the large one alone, the rest after it.
    assert [len(body["body"]) for body in bodies] == [len(b"".join(fragments[:3])), 3 << 20, 2]
    assert [body["more_body"] for body in bodies] == [True, True, False]


def test_an_encode_whose_client_left_stops_at_the_next_choice() -> None:
    pool = RequestWorkerPool(num_threads=1)
    encoded: list[int] = []
    started, finished = threading.Event(), threading.Event()

    def encode(num_choices: int, cancelled: threading.Event) -> list[bytes]:
        def choices() -> Iterator[int]:
            for index in range(num_choices):
                started.set()
                time.sleep(0.01)
                yield index

        out: list[bytes] = []
        encode_each(stop_when(cancelled, choices()), out, lambda index, out: encoded.append(index))
        finished.set()
        return out

    async def main() -> None:
        task = asyncio.ensure_future(encode_in_pool(pool, encode, 10_000))  # 100 s if run to the end
        await asyncio.get_running_loop().run_in_executor(None, started.wait)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        asyncio.run(main())
        assert finished.wait(timeout=30)
    finally:
        pool.shutdown()
    assert len(encoded) < 100  # it was running (started), then stopped at the next choice


def test_size_estimate_is_at_least_a_worst_case_choice(tokenizer: Any) -> None:
    # Every token the longest one of the vocabulary, every float the longest.
    longest_id = max(range(len(tokenizer)), key=lambda i: len(json.dumps(tokenizer.decode([i]), ensure_ascii=False)))
    longest = tokenizer.decode([longest_id])
    token_bytes = max_token_json_bytes(tokenizer)
    assert token_bytes == len(json.dumps(longest, ensure_ascii=False).encode()) - 2
    num_tokens, k, value = 50, 5, -1.2345678901234567e-05
    logprobs = CompletionLogProbs(
        text_offset=[10**9 + i for i in range(num_tokens)], token_logprobs=[value] * num_tokens,
        tokens=[longest] * num_tokens,
        # k + 1 distinct keys as long as the longest token (a dict cannot repeat one).
        top_logprobs=[{longest[:-1] + chr(0x41 + j): value for j in range(k + 1)}] * num_tokens,
    )
    choice = CompletionResponseChoice(index=127, text=longest * num_tokens, logprobs=logprobs,
                                      finish_reason="length", stop_reason="x" * 1000)
    size = len(choice.model_dump_json())
    estimate = CHOICE_BYTES + num_tokens * completion_token_bytes(token_bytes, k)
    assert size <= estimate < 1.25 * size
    top = ChatCompletionTopLogprob(token=longest, logprob=value, bytes=list(longest.encode()))
    entry = ChatCompletionLogprob(**top.model_dump(), top_logprobs=[top] * k)
    chat = ChatCompletionResponseChoice(
        index=127, message=ChatResponseMessage(content=longest * num_tokens),
        logprobs=ChatCompletionLogProbs(content=[entry] * num_tokens), finish_reason="length", stop_reason="x" * 1000,
    )
    size = len(chat.model_dump_json())
    estimate = CHOICE_BYTES + num_tokens * chat_token_bytes(token_bytes, k)
    assert size <= estimate < 1.5 * size


# -------------------------------------------------------- small helpers


def test_content_type_must_be_json_with_utf8_if_any() -> None:
    for accepted in ("application/json", "Application/JSON", "application/json; charset=utf-8",
                     'application/json;charset="UTF-8"'):
        assert json_content_type_problem([accepted]) is None, accepted
    for refused in ([], ["text/plain"], ["application/x-www-form-urlencoded"], ["multipart/form-data; boundary=x"],
                    ["application/json; charset=latin-1"], ["text/json"], ["application/json", "text/plain"]):
        assert json_content_type_problem(refused) is not None, refused


def test_an_echoed_value_keeps_its_start_and_says_its_length() -> None:
    assert echo("m" * MAX_ECHO_CHARS) == "m" * MAX_ECHO_CHARS
    assert echo("m" * 3_900_000) == "m" * MAX_ECHO_CHARS + "... (3900000 characters)"
    message = invalid_request_message(InvalidRequestError("stop.0", "s" * 50_000, "at most 1024 characters"))
    assert message == f"stop.0='{'s' * (MAX_ECHO_CHARS - 4)}... is invalid: at most 1024 characters"


def test_error_messages_are_bounded() -> None:
    message = error_body(400, "field: " + "x" * 100_000 + " limit 7")["error"]["message"]
    assert len(message) <= MAX_MESSAGE_CHARS + 5
    assert message.startswith("field: xxx") and message.endswith(" limit 7")


def test_new_limits_have_stated_defaults() -> None:
    config = ServerConfig()
    assert (config.max_response_bytes, config.body_read_timeout_s) == (256 << 20, 30.0)


# ------------------------------------------------------------ live server


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    port = free_port()
    script = Path(__file__).parent / "helpers" / "fake_engine.py"
    command = [sys.executable, str(script), str(port), "--body-read-timeout-s", str(BODY_READ_TIMEOUT_S)]
    with tempfile.NamedTemporaryFile(prefix="pagedllm-fake-", suffix=".log", delete=False) as log_file:
        process = subprocess.Popen(command, stdout=log_file, stderr=subprocess.STDOUT)
        server = ServerProcess(f"http://127.0.0.1:{port}", process.pid, process, Path(log_file.name))
        try:
            _wait_for_health(server)
            yield server
        finally:
            stop_server(server)
            Path(log_file.name).unlink()


def post(server: ServerProcess, path: str, body: Any, headers: dict[str, str] | None = JSON) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=120)


def num_generate_calls(server: ServerProcess) -> int:
    return int(httpx.get(f"{server.base_url}/metrics").text.split("fake_generate_calls ")[1].split()[0])


class HealthPoller:
    """GET /health every 20 ms on its own connection, in a thread."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.latencies: list[float] = []
        self.statuses: set[int] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=30) as client:
            while not self._stop.is_set():
                started = time.perf_counter()
                self.statuses.add(client.get("/health").status_code)
                self.latencies.append(time.perf_counter() - started)
                self._stop.wait(0.02)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


@pytest.mark.slow
def test_health_stays_fast_while_a_large_response_is_built(server: ServerProcess, tokenizer: Any) -> None:
    # 64 choices x 1,500 tokens x 21 logprobs: ~24 MB. Built and encoded on
    # the event loop (the old code) it stalled /health for seconds.
    num_choices, num_tokens = 64, 1500
    body = {"prompt": "hi", "n": num_choices, "max_tokens": num_tokens, "logprobs": 20}
    with HealthPoller(server.base_url) as poller:
        time.sleep(0.1)
        response = post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text[:1000]
    assert len(response.content) > 20e6 and int(response.headers["content-length"]) == len(response.content)
    choices = response.json()["choices"]
    token = tokenizer.decode([TOKEN_ID])
    top = {tokenizer.decode([token_id]): -0.5 * (rank + 1)
           for rank, token_id in enumerate(range(TOKEN_ID, TOKEN_ID + 21))}
    assert [choice["index"] for choice in choices] == list(range(num_choices))
    for choice in (choices[0], choices[-1]):
        assert choice["text"] == token * num_tokens
        logprobs = choice["logprobs"]
        assert logprobs["tokens"] == [token] * num_tokens and logprobs["token_logprobs"] == [-0.5] * num_tokens
        assert logprobs["text_offset"] == [len(token) * i for i in range(num_tokens)]
        assert logprobs["top_logprobs"] == [top] * num_tokens
    assert poller.statuses == {200} and len(poller.latencies) >= 5
    # Target < 100 ms; the bound is generous for a loaded 2-core machine.
    assert max(poller.latencies) < 1.0, sorted(poller.latencies)[-5:]


def test_response_over_the_size_bound_is_a_400_before_generation(server: ServerProcess) -> None:
    calls = num_generate_calls(server)
    body = {"prompt": "hello", "n": 128, "max_tokens": 1500, "logprobs": 20}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text[:1000]
    error = response.json()["error"]
    assert error["param"] == "max_tokens"
    for words in ("n=128", "max_tokens=1500", "logprobs=20", f"server.max_response_bytes = {MAX_RESPONSE_BYTES}",
                  "stream"):
        assert words in error["message"], error["message"]
    estimate = int(error["message"].split("could reach ")[1].split(" bytes")[0])
    assert estimate > MAX_RESPONSE_BYTES
    chat = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 128,
                                                 "max_completion_tokens": 1500, "logprobs": True,
                                                 "top_logprobs": 20})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "max_completion_tokens", chat.text
    assert num_generate_calls(server) == calls  # refused before the engine saw them
    # Streamed, the same request is not bounded (here: one choice, to keep it short).
    with httpx.stream("POST", f"{server.base_url}/v1/completions", timeout=60, headers=JSON,
                      content=json.dumps({**body, "n": 1, "stream": True}).encode()) as stream:
        assert stream.status_code == 200
    assert num_generate_calls(server) == calls + 1


JSON_ROUTES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [10, 11]},
}


def test_every_json_route_refuses_a_body_not_sent_as_json(server: ServerProcess) -> None:
    schema = httpx.get(f"{server.base_url}/openapi.json").json()
    body_routes = {path for path, item in schema["paths"].items()
                   if "application/json" in item.get("post", {}).get("requestBody", {}).get("content", {})}
    assert body_routes == set(JSON_ROUTES)
    for path, body in JSON_ROUTES.items():
        # What a web page can send cross-origin without a preflight, and no header at all.
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x",
                             None, "application/json; charset=latin-1"):
            response = post(server, path, body, {"content-type": content_type} if content_type else {})
            assert response.status_code == 415, (path, content_type, response.text)
            error = response.json()["error"]
            assert (error["type"], error["param"], error["code"]) == ("UnsupportedMediaTypeError", "content-type", 415)
            assert "application/json" in error["message"]
        accepted = post(server, path, body, {"content-type": "application/json; charset=utf-8"})
        assert accepted.status_code == 200, (path, accepted.text)


def test_unknown_model_404_quotes_only_the_start_of_a_huge_name(server: ServerProcess) -> None:
    name = "m" * 3_900_000
    response = post(server, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 1})
    assert response.status_code == 404
    assert len(response.content) < 1000
    message = response.json()["error"]["message"]
    assert f"`{'m' * MAX_ECHO_CHARS}... (3900000 characters)`" in message, message


def test_head_on_every_get_route_answers_as_get_without_a_body(server: ServerProcess) -> None:
    paths = ["/openapi.json", *(path for path, item in httpx.get(f"{server.base_url}/openapi.json").json()
                                ["paths"].items() if "get" in item)]
    assert {"/health", "/metrics", "/version", "/v1/models", "/server_info", "/v1/kv_events"} <= set(paths)
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        for path in paths:
            get, head = client.get(path), client.head(path)
            assert head.status_code == get.status_code, (path, head.status_code, get.status_code)
            assert head.content == b""
            assert head.headers.get("content-type") == get.headers.get("content-type"), path
        assert client.head("/version").headers["content-length"] == str(len(client.get("/version").content))
        # A POST-only route still says which method it takes.
        refused = client.head("/v1/completions")
        assert refused.status_code == 405 and refused.headers["allow"] == "POST"


def test_body_that_never_arrives_is_answered_408_and_the_connection_closed(server: ServerProcess) -> None:
    port = int(server.base_url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        started = time.monotonic()  # before the server can have seen the headers
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"prompt":')
        received = b""
        while chunk := sock.recv(65536):  # until the server closes the connection
            received += chunk
        elapsed = time.monotonic() - started
    assert received.startswith(b"HTTP/1.1 408 "), received
    head, _, body = received.partition(b"\r\n\r\n")
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert (error["type"], error["param"]) == ("RequestTimeoutError", "body")
    assert f"server.body_read_timeout_s = {BODY_READ_TIMEOUT_S:g} s" in error["message"]
    assert BODY_READ_TIMEOUT_S <= elapsed < BODY_READ_TIMEOUT_S + 10
    # The server still serves.
    assert post(server, "/tokenize", {"prompt": "hi"}).status_code == 200
