"""A rank of the `mp` executor (TP=2 over gloo) killed: in an in-process
`LLM` mid-generate (at any point, and while its peer waits in a collective,
where the peer fails too: the dead rank is the one named), under `pagedllm
serve` mid-stream, and while the server is idle and probed on /health more
often than the engine core's idle poll (each probe may ping the core).

The contract checked (executors/mp.py, engine/core_proc.py, the server's
fault policy): the request in flight fails with `RankFailedError` naming
the rank and how it died (the server: an error chunk saying so, then
[DONE]); every later call fails at once; /health answers 503 (the servers
here keep their API up with --keep-alive-on-engine-death, so 503 is
observable, not a refused connection); and once the engine is shut down no
rank process is left.

Deadlines are generous (the machine is shared and loaded): they catch a hang
or a failure noticed only by a much later timeout, not a slow second.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from helpers.processes import cpu_ticks, pid_of_rank, rank_processes, wait_busy_then_quiet, wait_gone
from helpers.server import ServerProcess, start_server, wait_until

from pagedllm import LLM, SamplingParams
from pagedllm.executors.base import RankFailedError

pytestmark = pytest.mark.slow

NUM_KV_BLOCKS = 64
# A dead rank is noticed within the executor's 50 ms poll, or the idle
# engine core's 1 s health check; anything under this counts as "at once".
NOTICE_DEADLINE_S = 20.0
# A later call on a failed executor must not wait for anything.
FAIL_FAST_DEADLINE_S = 5.0
# Rank processes stopping after shutdown (asked, SIGTERM, SIGKILL: 5 s each at most).
STOP_DEADLINE_S = 30.0
HANG_GUARD_S = 120.0
LONG_MAX_TOKENS = 900  # far more steps than the test waits for
MODEL_NAME = "tiny-tp2"
SERVER_ARGS = ("-tp", "2", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--keep-alive-on-engine-death",
               "--served-model-name", MODEL_NAME)


def _long_params() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=LONG_MAX_TOKENS, ignore_eos=True)


# ------------------------------------------------------------- in process


@contextmanager
def tp2_engine() -> Iterator[tuple[LLM, dict[int, int]]]:
    """An in-process LLM at TP=2 and its rank processes (pid -> rank); once
    it is shut down, none of them may be left."""
    before = set(rank_processes(os.getpid()))
    llm = LLM("tiny", tensor_parallel_size=2, num_kv_blocks=NUM_KV_BLOCKS)
    ranks = {pid: rank for pid, rank in rank_processes(os.getpid()).items() if pid not in before}
    try:
        assert sorted(ranks.values()) == [0, 1]
        yield llm, ranks
    finally:
        llm.shutdown()
    assert wait_gone(set(ranks), STOP_DEADLINE_S) == []


def _assert_rank_1_killed(error: RankFailedError, victim: int) -> None:
    assert error.rank == 1, str(error)
    assert str(error).startswith("executor rank 1 failed"), str(error)
    assert f"process {victim} killed by SIGKILL" in str(error)


def _assert_later_calls_fail_at_once(llm: LLM, error: RankFailedError) -> None:
    started = time.monotonic()
    with pytest.raises(RankFailedError) as later:
        llm.generate(["another"], SamplingParams(max_tokens=2), use_tqdm=False)
    assert time.monotonic() - started < FAIL_FAST_DEADLINE_S
    assert str(later.value) == str(error)


def _generate_while(llm: LLM, fault: Callable[[], None]) -> RankFailedError:
    """A long generate with `fault` run on another thread once the first step
    has returned (the request is then mid-decode); the error it failed with."""
    first_step = threading.Event()
    get_output = llm.engine_core.get_output

    def get_output_then_signal() -> Any:
        outputs = get_output()
        first_step.set()
        return outputs

    def fault_after_first_step() -> None:
        if first_step.wait(HANG_GUARD_S):
            fault()

    llm.engine_core.get_output = get_output_then_signal  # type: ignore[method-assign]
    thread = threading.Thread(target=fault_after_first_step, daemon=True)
    thread.start()
    with pytest.raises(RankFailedError) as info:
        llm.generate(["a long request"], _long_params(), use_tqdm=False)
    thread.join(HANG_GUARD_S)
    assert first_step.is_set(), "the first step never returned"
    return info.value


def test_rank_killed_mid_generate_fails_the_request_then_every_call_and_leaves_no_process() -> None:
    with tp2_engine() as (llm, ranks):
        victim = pid_of_rank(ranks, 1)
        killed_at: list[float] = []

        def kill() -> None:
            os.kill(victim, signal.SIGKILL)
            killed_at.append(time.monotonic())

        error = _generate_while(llm, kill)
        assert time.monotonic() - killed_at[0] < NOTICE_DEADLINE_S
        _assert_rank_1_killed(error, victim)
        _assert_later_calls_fail_at_once(llm, error)


def test_rank_killed_while_its_peer_waits_in_a_collective_is_the_rank_named() -> None:
    """Rank 1 stopped mid-step, so rank 0 blocks in the step's first
    collective; then rank 1 is killed. Rank 0's collective fails at once
    (connection reset), but the rank that failed is rank 1."""
    with tp2_engine() as (llm, ranks):
        victim, peer = pid_of_rank(ranks, 1), pid_of_rank(ranks, 0)

        def stop_then_kill_once_the_peer_waits() -> None:
            os.kill(victim, signal.SIGSTOP)
            try:
                # The next step reaches rank 0, which computes until its first
                # all-reduce and then waits for rank 1 there.
                assert wait_busy_then_quiet(peer, cpu_ticks(peer), quiet_s=1.0, timeout_s=HANG_GUARD_S)
            finally:
                os.kill(victim, signal.SIGKILL)

        error = _generate_while(llm, stop_then_kill_once_the_peer_waits)
        _assert_rank_1_killed(error, victim)
        _assert_later_calls_fail_at_once(llm, error)


# ----------------------------------------------------------------- server


@pytest.fixture
def server() -> Iterator[ServerProcess]:
    with start_server("tiny", *SERVER_ARGS) as srv:
        yield srv


def _ranks_of(server: ServerProcess) -> dict[int, int]:
    ranks = rank_processes(server.pid)
    assert sorted(ranks.values()) == [0, 1], (ranks, server.log()[-4000:])
    return ranks


def _health(server: ServerProcess) -> int:
    return httpx.get(f"{server.base_url}/health", timeout=30).status_code


def _stop_and_assert_no_process_left(server: ServerProcess, pids: list[int]) -> None:
    """SIGTERM the API process (by pid), then: it exits, and so has every
    process below it, before the fixture's clean-up would kill any by pid."""
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(timeout=HANG_GUARD_S)
    assert wait_gone(pids, STOP_DEADLINE_S) == []


def _rank_health_metrics(server: ServerProcess) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    return {
        sample.labels["rank"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "pagedllm:executor_rank_healthy"
    }


def test_server_rank_killed_mid_stream_ends_it_with_an_error_naming_the_rank(server: ServerProcess) -> None:
    ranks = _ranks_of(server)
    descendants = server.descendants()
    victim = pid_of_rank(ranks, 1)
    body = {"model": MODEL_NAME, "prompt": "Once upon a time", "max_tokens": LONG_MAX_TOKENS,
            "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=HANG_GUARD_S) as client:
        with client.stream("POST", f"{server.base_url}/v1/completions", json=body) as stream:
            assert stream.status_code == 200
            lines = stream.iter_lines()
            assert next(lines).startswith("data: {")  # generating
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            events = [line for line in lines if line]
            ended_at = time.monotonic()
    assert ended_at - killed_at < NOTICE_DEADLINE_S
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert (error["code"], error["type"]) == (503, "ServiceUnavailableError")
    assert "executor rank 1 failed" in error["message"]
    assert f"process {victim} killed by SIGKILL" in error["message"]
    assert _health(server) == 503
    # The other rank is stopped by the dying engine core, not left waiting in a collective.
    assert wait_gone(list(ranks), STOP_DEADLINE_S) == []
    _stop_and_assert_no_process_left(server, descendants)


def test_server_rank_killed_while_idle_turns_health_503_under_frequent_probes(server: ServerProcess) -> None:
    ranks = _ranks_of(server)
    descendants = server.descendants()
    assert _health(server) == 200
    assert _rank_health_metrics(server) == {"0": 1.0, "1": 1.0}
    os.kill(pid_of_rank(ranks, 1), signal.SIGKILL)
    killed_at = time.monotonic()
    answers: list[tuple[int, str]] = []

    def failure_named() -> bool:
        response = httpx.get(f"{server.base_url}/health", timeout=30)
        message = "" if response.status_code == 200 else response.json()["error"]["message"]
        answers.append((response.status_code, message))
        return response.status_code == 503 and "executor rank 1 failed" in message

    # Polled as a load balancer would (each /health may ping the engine core).
    assert wait_until(failure_named, timeout_s=3 * NOTICE_DEADLINE_S, interval_s=0.2), answers[-3:]
    assert time.monotonic() - killed_at < NOTICE_DEADLINE_S, answers
    statuses = [status for status, _ in answers]
    assert 200 not in statuses[statuses.index(503):]  # once unhealthy, never healthy again
    assert _rank_health_metrics(server) == {"0": 1.0, "1": 0.0}
    # A new request is refused with the same cause rather than queued forever.
    refused = httpx.post(f"{server.base_url}/v1/completions", timeout=HANG_GUARD_S,
                         json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
    assert refused.status_code == 503
    assert "executor rank 1 failed" in refused.json()["error"]["message"]
    assert wait_gone(list(ranks), STOP_DEADLINE_S) == []
    _stop_and_assert_no_process_left(server, descendants)
