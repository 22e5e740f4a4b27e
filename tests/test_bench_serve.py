"""`pagedllm bench serve` against a fake OpenAI-compatible streaming server with
known timing, and its metric arithmetic against hand-computed values."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pagedllm.core.errors import ConfigError
from pagedllm.entrypoints.bench.datasets import SAFE_TOKEN_ID_RANGE, sample_random_requests, token_id_pool
from pagedllm.entrypoints.bench.metrics import (
    RequestRecord,
    compute_metrics,
    parse_goodput,
    percentile,
)
from pagedllm.entrypoints.bench.serve import BenchServeConfig, arrival_offsets, run_benchmark
from pagedllm.entrypoints.cli import main

MODEL_ID = "fake-model"


# ---- the fake server ---------------------------------------------------


@dataclass
class FakeServer:
    """A streaming /v1/completions that sleeps `ttft_s` before the first chunk and
    `itl_s` between chunks; the n-th request to arrive fails as `failures[n]` says."""

    ttft_s: float = 0.05
    itl_s: float = 0.02
    tokens_per_chunk: int = 1
    send_usage: bool = True
    failures: dict[int, str] = field(default_factory=dict)
    base_url: str = ""
    received: list[dict[str, Any]] = field(default_factory=list)
    auth_headers: list[str | None] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def build_app(self) -> Any:
        app = FastAPI()

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "owned_by": "test"}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Any:
            body = await request.json()
            ordinal = len(self.received)
            self.received.append(body)
            self.auth_headers.append(request.headers.get("authorization"))
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            mode = self.failures.get(ordinal)
            if mode == "http500":
                self.in_flight -= 1
                return JSONResponse({"error": {"message": "boom", "type": "InternalServerError"}}, 500)
            return StreamingResponse(self._stream(body, mode), media_type="text/event-stream")

        return app

    async def _stream(self, body: dict[str, Any], mode: str | None) -> Any:
        try:
            max_tokens = body["max_tokens"]
            num_chunks = math.ceil(max_tokens / self.tokens_per_chunk)
            await asyncio.sleep(30.0 if mode == "hang" else self.ttft_s)
            for index in range(num_chunks):
                if index > 0:
                    await asyncio.sleep(self.itl_s)
                if index == 1 and mode == "error_chunk":
                    yield _sse({"error": {"message": "engine died", "type": "ServiceUnavailableError"}})
                    yield "data: [DONE]\n\n"
                    return
                if index == 1 and mode == "truncate":
                    return  # a clean end of the body, but no [DONE]
                if index == 1 and mode == "crash":
                    raise RuntimeError("server broke mid-stream")
                last = index == num_chunks - 1
                yield _sse({
                    "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": MODEL_ID,
                    "choices": [{"index": 0, "text": f" t{index}", "logprobs": None,
                                 "finish_reason": "length" if last else None}],
                    "usage": None,
                })
            if self.send_usage and body.get("stream_options", {}).get("include_usage"):
                prompt_tokens = len(body["prompt"])
                yield _sse({
                    "id": "cmpl-fake", "object": "text_completion", "created": 0, "model": MODEL_ID,
                    "choices": [],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": max_tokens,
                              "total_tokens": prompt_tokens + max_tokens},
                })
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


@contextlib.contextmanager
def serving(fake: FakeServer) -> Iterator[FakeServer]:
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake.build_app(), log_level="critical", timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # a hang guard only
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("fake server did not start")
        time.sleep(0.01)
    fake.base_url = f"http://127.0.0.1:{port}"
    try:
        yield fake
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def bench(fake: FakeServer, **overrides: Any) -> Any:
    config = BenchServeConfig(base_url=fake.base_url, disable_tqdm=True, **overrides)
    return asyncio.run(run_benchmark(config))


# ---- end to end against the fake server --------------------------------


def test_counts_timings_and_failures_against_fake_server() -> None:
    fake = FakeServer(ttft_s=0.05, itl_s=0.02, failures={1: "http500", 3: "error_chunk", 4: "crash", 5: "truncate"})
    with serving(fake):
        result = bench(fake, num_prompts=7, input_len=8, output_len=5, prefix_len=3, seed=7,
                       goodput=parse_goodput(["ttft:10000"]))
    metrics = result.metrics
    assert result.model == MODEL_ID  # from GET /v1/models
    assert (metrics.num_prompts, metrics.completed, metrics.failed) == (7, 3, 4)
    assert metrics.total_output_tokens == 3 * 5
    assert metrics.total_input_tokens == 3 * (3 + 8)
    # every failure is a goodput miss even with an SLO everybody else meets
    assert metrics.good_completions == 3
    assert metrics.goodput == pytest.approx(3 / metrics.duration_s)
    assert metrics.request_throughput == pytest.approx(3 / metrics.duration_s)
    assert metrics.output_throughput == pytest.approx(15 / metrics.duration_s)

    # one failure of each kind, whichever request arrived n-th
    errors = sorted(r.error.split(":")[0] for r in result.records if not r.success)
    assert errors == ["HTTP 500", "RemoteProtocolError", "error chunk", "stream ended before data"]

    for record in (r for r in result.records if r.success):
        assert record.output_tokens == 5 and record.output_tokens_from_usage
        assert len(record.itl) == 4
        assert record.generated_text == " t0 t1 t2 t3 t4"
        # the server slept these before answering, so the client cannot see less
        assert 0.05 <= record.ttft < record.e2e
        assert record.e2e >= 0.05 + 4 * 0.02
        assert record.tpot == pytest.approx((record.e2e - record.ttft) / 4)
        assert sum(record.itl) / 4 > 0.005 and record.ttft + sum(record.itl) <= record.e2e
    assert metrics.ttft_ms.p50 >= 50.0 and metrics.e2e_ms.p50 >= 130.0

    # what was sent: the vLLM-compatible streaming request with a shared prefix
    prompts = [body["prompt"] for body in fake.received]
    assert len(prompts) == 7 and all(len(p) == 11 for p in prompts)
    assert len({tuple(p[:3]) for p in prompts}) == 1 and len({tuple(p) for p in prompts}) == 7
    for body in fake.received:
        assert body["model"] == MODEL_ID and body["max_tokens"] == 5
        assert body["stream"] is True and body["ignore_eos"] is True
        assert body["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("tokens_per_chunk", "send_usage", "expected_tokens", "expected_chunks"),
    [(1, False, 4, 4), (2, True, 4, 2), (2, False, 2, 2)],
)
def test_output_tokens_come_from_usage_else_chunk_count(
    tokens_per_chunk: int, send_usage: bool, expected_tokens: int, expected_chunks: int
) -> None:
    fake = FakeServer(ttft_s=0.0, itl_s=0.0, tokens_per_chunk=tokens_per_chunk, send_usage=send_usage)
    with serving(fake):
        result = bench(fake, num_prompts=2, input_len=4, output_len=4, model="named")
    assert [body["model"] for body in fake.received] == ["named", "named"]
    for record in result.records:
        assert record.success
        assert (record.output_tokens, record.num_chunks) == (expected_tokens, expected_chunks)
        assert record.output_tokens_from_usage is send_usage
        assert len(record.itl) == expected_chunks - 1
    assert result.metrics.total_output_tokens == 2 * expected_tokens


def test_max_concurrency_is_never_exceeded() -> None:
    fake = FakeServer(ttft_s=0.03, itl_s=0.01)
    with serving(fake):
        result = bench(fake, num_prompts=10, input_len=4, output_len=3, max_concurrency=3)
    assert result.metrics.completed == 10
    # all ten are offered at once, so the cap is reached and held
    assert fake.max_in_flight == 3
    # client side too: never more than 3 requests between send and end of stream
    events = sorted([(r.start_time, 1) for r in result.records] + [(r.start_time + r.e2e, -1) for r in result.records],
                    key=lambda event: (event[0], event[1]))
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak <= 3


def test_stalled_request_times_out_and_the_benchmark_ends() -> None:
    fake = FakeServer(ttft_s=0.0, itl_s=0.0, failures={0: "hang"})
    with serving(fake):
        result = bench(fake, num_prompts=2, input_len=4, output_len=2, max_concurrency=1, request_timeout_s=0.5)
    # It returned: the stalled request was cut by its timeout, and the other one completed.
    assert (result.metrics.completed, result.metrics.failed) == (1, 1)
    assert result.records[0].error == "timed out after 0.5 s"
    assert result.records[0].e2e >= 0.5


def test_requests_are_sent_at_their_poisson_arrival_times() -> None:
    fake = FakeServer(ttft_s=0.0, itl_s=0.0)
    with serving(fake):
        result = bench(fake, num_prompts=6, input_len=4, output_len=1, request_rate=20.0, seed=3)
    offsets = arrival_offsets(6, 20.0, seed=3)
    # Never before its arrival time, and in arrival order.
    for record, offset in zip(result.records, offsets, strict=True):
        assert record.start_time >= offset - 0.001
    assert [r.start_time for r in result.records] == sorted(r.start_time for r in result.records)
    # one output token: no TPOT, but the request is a completion
    assert result.metrics.completed == 6 and result.metrics.tpot_ms.mean == 0.0


def test_cli_writes_report_and_strict_json_result(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    result_file = tmp_path / "result.json"
    fake = FakeServer(ttft_s=0.0, itl_s=0.0, failures={2: "http500"})
    with serving(fake):
        rc = main(["bench", "serve", "--base-url", fake.base_url, "--num-prompts", "4", "--input-len", "6",
                   "--output-len", "3", "--goodput", "ttft:10000", "e2el:10000", "--api-key", "secret",
                   "--result-file", str(result_file), "--disable-tqdm"])
    assert rc == 0
    assert fake.auth_headers == ["Bearer secret"] * 4
    report = capsys.readouterr().out
    assert "Successful requests:" in report and "Request goodput (req/s):" in report
    assert [line.split()[-1] for line in report.splitlines() if line.startswith("Failed requests:")] == ["1"]

    def reject(constant: str) -> None:
        raise AssertionError(f"non-standard JSON constant {constant}")

    payload = json.loads(result_file.read_text(), parse_constant=reject)
    assert payload["model"] == MODEL_ID
    assert (payload["completed"], payload["failed"], payload["good_completions"]) == (3, 1, 3)
    assert payload["total_output_tokens"] == 9 and payload["total_input_tokens"] == 18
    assert payload["goodput"] == pytest.approx(3 / payload["duration_s"])
    assert payload["config"]["request_rate"] == "inf" and "api_key" not in payload["config"]
    assert payload["config"]["goodput"] == {"ttft": 10000.0, "e2e": 10000.0}
    for name in ("ttft", "tpot", "itl", "e2e"):
        for stat in ("mean", "median", "p99"):
            assert isinstance(payload[f"{stat}_{name}_ms"], float)
    assert len(payload["requests"]) == 4
    assert [r["success"] for r in payload["requests"]].count(False) == 1
    assert {"ttft", "tpot", "itl", "e2e", "output_tokens", "error", "start_time"} <= set(payload["requests"][0])


def test_cli_reports_an_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    rc = main(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--num-prompts", "1", "--disable-tqdm"])
    assert rc == 1
    assert "cannot reach" in capsys.readouterr().err


# ---- schedule and dataset ----------------------------------------------


def test_poisson_schedule_is_seeded_and_reproducible() -> None:
    offsets = arrival_offsets(50, 4.0, seed=1)
    assert offsets == arrival_offsets(50, 4.0, seed=1)
    assert offsets != arrival_offsets(50, 4.0, seed=2)
    assert offsets[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(offsets))
    # exponential gaps with mean 1/rate
    long_run = arrival_offsets(4001, 4.0, seed=1)
    assert long_run[-1] / 4000 == pytest.approx(0.25, rel=0.05)
    assert arrival_offsets(5, math.inf, seed=1) == [0.0] * 5


def test_random_dataset_is_seeded_with_a_shared_prefix() -> None:
    pool = list(range(100, 120))
    requests = sample_random_requests(5, input_len=6, output_len=9, prefix_len=4, seed=11, token_ids=pool)
    assert requests == sample_random_requests(5, 6, 9, 4, seed=11, token_ids=pool)
    assert requests != sample_random_requests(5, 6, 9, 4, seed=12, token_ids=pool)
    assert all(len(r.prompt_token_ids) == 10 and r.output_len == 9 for r in requests)
    assert len({tuple(r.prompt_token_ids[:4]) for r in requests}) == 1
    assert all(set(r.prompt_token_ids) <= set(pool) for r in requests)
    with pytest.raises(ConfigError, match="--input-len"):
        sample_random_requests(1, input_len=0, output_len=1)


def test_prompt_families_share_one_of_several_prefixes_in_random_order() -> None:
    pool = list(range(100, 400))
    requests = sample_random_requests(64, input_len=3, output_len=2, prefix_len=8, seed=5, token_ids=pool,
                                      num_prefixes=4)
    prefixes = [tuple(r.prompt_token_ids[:8]) for r in requests]
    assert len(set(prefixes)) == 4 and all(len(r.prompt_token_ids) == 11 for r in requests)
    first_seen = list(dict.fromkeys(prefixes))
    assert [first_seen.index(prefix) for prefix in prefixes[:8]] != sorted(first_seen.index(p) for p in prefixes[:8])
    # One prefix draws nothing more: a seed keeps the prompts it gave before families existed.
    assert sample_random_requests(5, 6, 9, 4, seed=11, token_ids=pool, num_prefixes=1) == sample_random_requests(
        5, 6, 9, 4, seed=11, token_ids=pool)
    with pytest.raises(ConfigError, match="--num-prefixes"):
        sample_random_requests(1, 1, 1, num_prefixes=0)


def test_token_id_pool_is_the_tokenizer_vocabulary_without_special_tokens() -> None:
    from pagedllm.model_registry.tiny import get_tokenizer_dir
    from pagedllm.model_registry.tiny.tokenizer import SPECIAL_TOKENS, VOCAB_SIZE

    pool = token_id_pool(str(get_tokenizer_dir()))
    # the embedded tokenizer's specials are ids 0..4
    assert pool == list(range(len(SPECIAL_TOKENS), VOCAB_SIZE))
    assert token_id_pool(None) == list(range(*SAFE_TOKEN_ID_RANGE))


# ---- metric arithmetic -------------------------------------------------


def test_percentile_interpolates_linearly_between_ranks() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)  # rank 2.97
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) == 0.0


def _synthetic_records() -> list[RequestRecord]:
    def done(index: int, ttft: float, e2e: float, tokens: int, itl: list[float]) -> RequestRecord:
        return RequestRecord(index=index, prompt_len=10, output_len_requested=5, success=True,
                             ttft=ttft, e2e=e2e, itl=itl, output_tokens=tokens)

    failed = RequestRecord(index=3, prompt_len=10, output_len_requested=5, success=False, error="HTTP 500",
                           ttft=0.05, e2e=0.1, output_tokens=5)  # fast, but it failed
    return [
        done(0, ttft=0.1, e2e=0.5, tokens=5, itl=[0.1, 0.1, 0.1, 0.1]),  # TPOT 0.4 / 4 = 0.1
        done(1, ttft=0.2, e2e=1.0, tokens=3, itl=[0.4, 0.4]),  # TPOT 0.8 / 2 = 0.4
        done(2, ttft=0.3, e2e=0.3, tokens=1, itl=[]),  # one token: no TPOT
        failed,
    ]


def test_summary_metrics_equal_hand_computed_values() -> None:
    metrics = compute_metrics(_synthetic_records(), duration_s=2.0)
    assert (metrics.num_prompts, metrics.completed, metrics.failed) == (4, 3, 1)
    assert (metrics.total_input_tokens, metrics.total_output_tokens) == (30, 9)
    assert metrics.request_throughput == pytest.approx(1.5)
    assert metrics.output_throughput == pytest.approx(4.5)
    assert metrics.total_token_throughput == pytest.approx(19.5)
    # TTFT over completions only: [100, 200, 300] ms; p99 at rank 1.98
    assert (metrics.ttft_ms.mean, metrics.ttft_ms.p50, metrics.ttft_ms.p99) == pytest.approx((200, 200, 298))
    # TPOT only where > 1 token: [100, 400] ms; p99 at rank 0.99
    assert (metrics.tpot_ms.mean, metrics.tpot_ms.p50, metrics.tpot_ms.p99) == pytest.approx((250, 250, 397))
    # ITL pooled: [100, 100, 100, 100, 400, 400] ms
    assert (metrics.itl_ms.mean, metrics.itl_ms.p50, metrics.itl_ms.p99) == pytest.approx((200, 100, 400))
    # E2E: [300, 500, 1000] ms
    assert (metrics.e2e_ms.mean, metrics.e2e_ms.p50, metrics.e2e_ms.p99) == pytest.approx((600, 500, 990))
    assert metrics.good_completions is None and metrics.goodput is None


@pytest.mark.parametrize(
    ("specs", "expected_good"),
    [
        (["ttft:250", "tpot:200"], 1),  # 0 meets both; 1 misses TPOT; 2 misses TTFT; 3 failed
        (["e2e:400", "tpot:1"], 1),  # only 2 (a one-token completion has no TPOT to miss); 3 failed
        (["ttft:10000"], 3),  # every completion, never the failure
        (["ttft:1"], 0),
    ],
)
def test_goodput_counts_failures_as_misses(specs: list[str], expected_good: int) -> None:
    metrics = compute_metrics(_synthetic_records(), duration_s=2.0, slos=parse_goodput(specs))
    assert metrics.good_completions == expected_good
    assert metrics.goodput == pytest.approx(expected_good / 2.0)


def test_parse_goodput_reads_milliseconds_and_rejects_bad_specs() -> None:
    assert parse_goodput(["ttft:200", "tpot:50", "e2el:1000"]) == pytest.approx(
        {"ttft": 0.2, "tpot": 0.05, "e2e": 1.0})
    assert parse_goodput(None) == {}
    for bad in ("ttft", "foo:1", "ttft:-1", "ttft:abc", "tpot:nan"):
        with pytest.raises(ConfigError, match="--goodput"):
            parse_goodput([bad])
