"""Data-parallel engines behind one front end (issue 16): `LLM(...,
data_parallel_size=2)` and `pagedllm serve -dp 2` give a single engine's
greedy tokens; with 8 prompt families arriving in random order,
`prefix_aware` sends each family's repeats to the replica that cached it
(its predicted hit tokens equal the replicas' reported ones) and its
prefix-cache hit count beats `round_robin`'s and `least_loaded`'s (exact
counts read from /metrics' text); a replica killed under load (issue 30:
six streaming clients and a non-streaming one) is seen at once whatever the
other replica is doing: the requests it held end with a clear 503 error,
every later request goes to the survivor and succeeds, and /health says
degraded."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from helpers.server import is_alive, start_server, wait_until

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import EngineDeadError
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.dp_client import DPAsyncMPClient
from pagedllm.engine.outputs import RequestOutputKind

pytestmark = pytest.mark.slow

BLOCK = 16
NUM_KV_BLOCKS = 96  # per replica: enough for every family it caches
PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _prompts(num: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 4000) for _ in range(length)] for _ in range(num)]


def _single_engine(prompts: list[list[int]], texts: bool = False) -> list[Any]:
    """A single engine's greedy tokens (or texts) for `prompts`."""
    llm = LLM("tiny", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        return [o.outputs[0].text if texts else list(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.shutdown()


def test_llm_with_two_replicas_gives_a_single_engines_tokens() -> None:
    prompts = _prompts(6, 40, seed=1)
    expected = _single_engine(prompts)
    llm = LLM("tiny", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, data_parallel_size=2)
    try:
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
        router = llm.engine_core.router  # type: ignore[attr-defined]
        assert [book.num_routed for book in router.books] == [3, 3]  # a batch at once: spread by load
        pids = [client.engine_pid for client in llm.engine_core.clients]  # type: ignore[attr-defined]
        assert len(set(pids)) == 2
    finally:
        llm.shutdown()


def test_two_replicas_of_two_ranks_are_four_rank_processes_with_a_single_engines_tokens() -> None:
    from helpers.processes import rank_processes, wait_gone

    prompts = _prompts(4, 40, seed=5)
    expected = _single_engine(prompts)
    llm = LLM("tiny", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, data_parallel_size=2, tensor_parallel_size=2)
    ranks: dict[int, int] = {}
    try:
        engine_pids = [client.engine_pid for client in llm.engine_core.clients]  # type: ignore[attr-defined]
        per_replica = [rank_processes(pid) for pid in engine_pids]
        assert [sorted(found.values()) for found in per_replica] == [[0, 1], [0, 1]]
        ranks = {pid: rank for found in per_replica for pid, rank in found.items()}
        assert len(ranks) == 4  # each replica its own executor and ranks
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    finally:
        llm.shutdown()
    assert wait_gone(set(ranks), 30.0) == []


# ------------------------------------------------------------ the policies

NUM_FAMILIES = 8
REPEATS = 3  # requests per family
PREFIX_BLOCKS = 3


def _family_workload() -> list[list[int]]:
    """8 families of a 3-block prefix, each asked 3 times with its own
    2-token suffix, in a seeded random order."""
    prefixes = _prompts(NUM_FAMILIES, PREFIX_BLOCKS * BLOCK, seed=2)
    workload = [prefix + [20 + family, 30 + repeat] for family, prefix in enumerate(prefixes) for repeat in
                range(REPEATS)]
    random.Random(3).shuffle(workload)
    return workload


def _metric(text: str, name: str, replica: int | None = None) -> float:
    """The sum of `name`'s samples (of one replica when given)."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and (replica is None or f'replica="{replica}"' in line):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def _serve_workload(policy: str, workload: list[list[int]]) -> tuple[list[list[int]], str]:
    config = EngineConfig.from_flat(model="tiny", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS,
                                    data_parallel_size=2, routing_policy=policy)
    llm = await AsyncLLM.create(config)
    try:
        tokens = []
        for index, prompt in enumerate(workload):  # one at a time: the decisions are deterministic
            async for output in llm.generate(prompt, PARAMS, f"{policy}-{index}",
                                             output_kind=RequestOutputKind.FINAL_ONLY):
                last = output
            tokens.append(list(last.outputs[0].token_ids))
        return tokens, llm.stat_logger.render().decode()
    finally:
        llm.shutdown()


def test_prefix_aware_routes_each_family_to_its_cache_and_beats_load_only_routing() -> None:
    workload = _family_workload()
    expected = _single_engine(workload)
    runs = {policy: asyncio.run(_serve_workload(policy, workload))
            for policy in ("prefix_aware", "round_robin", "least_loaded")}
    hits = {policy: _metric(text, "pagedllm:prefix_cache_hits_total") for policy, (_, text) in runs.items()}
    for policy, (tokens, text) in runs.items():
        assert tokens == expected, policy
        assert _metric(text, "pagedllm:prefix_cache_queries_total") == sum(len(p) for p in workload)
        assert _metric(text, "pagedllm:router_requests_total") == len(workload)
        # The router's view of the replicas' caches is exact.
        assert _metric(text, "pagedllm:router_predicted_hit_tokens_total") == hits[policy], policy
        assert _metric(text, "pagedllm:router_actual_hit_tokens_total") == hits[policy], policy
    prefix_text = runs["prefix_aware"][1]
    repeats = NUM_FAMILIES * (REPEATS - 1)
    # Every repeat went where its family's prefix was cached, and hit all of it.
    assert _metric(prefix_text, "pagedllm:router_prefix_routed_requests_total") == repeats
    assert hits["prefix_aware"] == repeats * PREFIX_BLOCKS * BLOCK
    # New families spread over both replicas.
    assert all(_metric(prefix_text, "pagedllm:router_requests_total", replica) > 0 for replica in (0, 1))
    assert hits["prefix_aware"] > hits["round_robin"] and hits["prefix_aware"] > hits["least_loaded"]


# ------------------------------------------------------- a replica that dies


async def _tokens(llm: AsyncLLM, prompt: list[int], request_id: str) -> tuple[list[int], str | None]:
    async for output in llm.generate(prompt, PARAMS, request_id, output_kind=RequestOutputKind.FINAL_ONLY):
        last = output
    return list(last.outputs[0].token_ids), last.outputs[0].finish_reason


async def _replica_dies_after_taking_a_request() -> None:
    config = EngineConfig.from_flat(model="tiny", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS,
                                    data_parallel_size=2, routing_policy="round_robin")
    llm = AsyncLLM(config, in_process=True)
    try:
        prompt, long_prompt = _prompts(2, 40, seed=6)
        # Round robin: "running" on replica 0 (it has output), "reference" on replica 1.
        running = llm.generate(long_prompt, SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True),
                               "running")
        assert (await anext(running)).outputs[0].token_ids
        expected = await _tokens(llm, prompt, "reference")
        dp = llm.engine_core
        assert isinstance(dp, DPAsyncMPClient)
        replica0 = dp.clients[0]
        take = replica0.add_requests

        def take_then_die(requests: list[Any]) -> None:
            take(requests)  # (a core in a thread cannot be killed: its client says it died)
            replica0.dead_error = EngineDeadError("replica 0 died after it took the request")

        replica0.add_requests = take_then_die  # type: ignore[method-assign]
        # "moved" goes to replica 0 (its turn), which dies before any of it came back.
        assert await _tokens(llm, prompt, "moved") == expected
        with pytest.raises(EngineDeadError, match="replica 0 died"):
            async for _ in running:
                pass
        assert [book.num_routed for book in dp.router.books] == [2, 2]  # "moved" routed twice
        assert [(r["replica"], r["alive"]) for r in llm.replica_health() or []] == [(0, False), (1, True)]
        assert await _tokens(llm, prompt, "after") == expected  # replica 1 serves on
    finally:
        llm.shutdown()


def test_requests_with_no_output_move_off_a_dead_replica_and_those_with_output_fail() -> None:
    asyncio.run(_replica_dies_after_taking_a_request())


# ---------------------------------------------------------------- the server


def _complete(server: Any, prompt: list[int], max_tokens: int = 6, **extra: Any) -> httpx.Response:
    body = {"model": "pagedllm-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, **extra}
    return httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60.0)


# A replica killed under load (issue 30). NOTE: the target is under 1 s; the
# bound is generous so that a loaded CI machine does not flake.
NOTICE_BOUND_S = 5.0
LOAD_CLIENTS = 7  # six streaming, one not
LOAD_MAX_TOKENS = 48


@dataclass
class Outcome:
    stream: bool
    started_at: float
    ended_at: float = 0.0
    status: int = 0
    error: dict[str, Any] | None = None  # a stream's error event, or the error body
    done: bool = False  # a stream's [DONE]
    num_events: int = 0  # a stream's data lines so far


@dataclass
class KillRun:
    killed_at: float
    noticed_at: float | None  # when /health first said degraded
    outcomes: list[Outcome]
    health_seen: list[tuple[float, int, str]]


async def _one_request(client: httpx.AsyncClient, url: str, prompt: list[int], outcome: Outcome) -> Outcome:
    body = {"model": "pagedllm-tiny", "prompt": prompt, "max_tokens": LOAD_MAX_TOKENS, "temperature": 0.0,
            "ignore_eos": True, "stream": outcome.stream}
    if outcome.stream:
        async with client.stream("POST", url, json=body) as response:
            outcome.status = response.status_code
            if response.status_code != 200:
                outcome.error = json.loads(await response.aread())["error"]
            async for line in response.aiter_lines():
                outcome.num_events += line.startswith("data: ")
                outcome.done = outcome.done or line == "data: [DONE]"
                if line.startswith("data: {"):
                    outcome.error = json.loads(line.removeprefix("data: ")).get("error", outcome.error)
    else:
        response = await client.post(url, json=body)
        outcome.status, outcome.error = response.status_code, response.json().get("error")
    outcome.ended_at = time.monotonic()
    return outcome


async def _kill_replica_under_load(base_url: str, prompts: list[list[int]], pid: int) -> KillRun:
    """Clients send requests back to back; once every stream in flight has
    output (a request with none yet would be moved to the other replica, not
    failed), SIGKILL `pid`; /health is polled until it says degraded (at most NOTICE_BOUND_S),
    then the load goes on for two more requests per client."""
    outcomes: list[Outcome] = []
    current: dict[int, Outcome] = {}
    stop = asyncio.Event()

    async def client_loop(client: httpx.AsyncClient, index: int) -> None:
        while not stop.is_set():
            current[index] = Outcome(stream=index > 0, started_at=time.monotonic())
            prompt = prompts[index % len(prompts)]
            outcomes.append(await _one_request(client, f"{base_url}/v1/completions", prompt, current[index]))

    async def outcomes_reach(count: int) -> None:
        while len(outcomes) < count:
            await asyncio.sleep(0.01)

    async def every_stream_has_output() -> None:
        while len(current) < LOAD_CLIENTS or not all(o.num_events for o in current.values() if o.stream):
            await asyncio.sleep(0.01)

    async with httpx.AsyncClient(timeout=60.0, limits=httpx.Limits(max_connections=2 * LOAD_CLIENTS)) as client:
        tasks = [asyncio.create_task(client_loop(client, index)) for index in range(LOAD_CLIENTS)]
        await asyncio.wait_for(every_stream_has_output(), 60.0)
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        noticed_at, health_seen = None, []
        while noticed_at is None and time.monotonic() - killed_at < NOTICE_BOUND_S:
            response = await client.get(f"{base_url}/health")
            health_seen.append((time.monotonic() - killed_at, response.status_code, response.text[:200]))
            if response.status_code == 200 and response.text and response.json()["status"] == "degraded":
                noticed_at = time.monotonic()
            await asyncio.sleep(0.02)
        if noticed_at is not None:
            await asyncio.wait_for(outcomes_reach(len(outcomes) + 2 * LOAD_CLIENTS), 60.0)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 60.0)
    return KillRun(killed_at, noticed_at, outcomes, health_seen)


def test_serve_dp2_gives_a_single_engines_tokens_and_survives_a_dead_replica() -> None:
    prompts = _prompts(4, 40, seed=4)
    expected = _single_engine(prompts, texts=True)
    # A short health timeout: a health ping left waiting on the dead replica would show as a 503.
    with start_server("tiny", "--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS), "-dp", "2",
                      "--routing-policy", "round_robin", "--keep-alive-on-engine-death",
                      "--health-timeout-s", "1") as server:
        for _ in range(2):  # each prompt on each replica (round robin)
            for prompt, text in zip(prompts, expected, strict=True):
                response = _complete(server, prompt)
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["text"] == text
        info = httpx.get(f"{server.base_url}/server_info").json()
        pids = info["engine_pids"]
        assert len(pids) == 2 and all(is_alive(pid) for pid in pids)
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert [_metric(metrics, "pagedllm:router_requests_total", r) for r in (0, 1)] == [4, 4]

        # Replica 0 dies while both serve six streaming clients and a non-streaming one.
        run = asyncio.run(_kill_replica_under_load(server.base_url, prompts, pids[0]))
        assert run.noticed_at is not None, f"/health never said degraded: {run.health_seen[-3:]}"
        assert run.noticed_at - run.killed_at < NOTICE_BOUND_S, run.health_seen
        in_flight = [o for o in run.outcomes if o.started_at < run.killed_at < o.ended_at]
        failed = [o for o in in_flight if o.error is not None]
        assert failed, in_flight  # the kill hit requests in flight on replica 0
        for outcome in failed:  # each ended at once with an OpenAI-shaped 503
            assert outcome.ended_at - run.killed_at < NOTICE_BOUND_S, outcome
            assert outcome.error["code"] == 503 and "engine core died" in outcome.error["message"], outcome
            # A stream already answering: its error event, then [DONE]; one not yet: a 503 as JSON.
            assert (outcome.status, outcome.done) in ((503, False), (200, True)) if outcome.stream else \
                outcome.status == 503, outcome
        # The survivor's requests went on; every request after the notice went to it and succeeded.
        assert all(o.status == 200 for o in in_flight if o.error is None), in_flight
        after = [o for o in run.outcomes if o.started_at > run.noticed_at]
        assert len(after) >= LOAD_CLIENTS
        assert [(o.status, o.error) for o in after] == [(200, None)] * len(after)
        response = httpx.get(f"{server.base_url}/health")
        assert response.status_code == 200, response.text  # (not 503: no health ping waits on the dead one)
        health = response.json()
        assert health["status"] == "degraded"
        assert [(r["replica"], r["alive"]) for r in health["replicas"]] == [(0, False), (1, True)]
        for prompt in prompts:  # every new request goes to the survivor
            assert _complete(server, prompt).status_code == 200
        metrics = httpx.get(f"{server.base_url}/metrics").text
        assert _metric(metrics, "pagedllm:replica_healthy", 0) == 0
        assert _metric(metrics, "pagedllm:replica_healthy", 1) == 1

        # The last replica dies too: /health is 503 and names both causes.
        os.kill(pids[1], signal.SIGKILL)
        assert wait_until(lambda: httpx.get(f"{server.base_url}/health").status_code == 503, 10.0)
        message = httpx.get(f"{server.base_url}/health").json()["error"]["message"]
        assert "every engine replica died" in message and "replica 0" in message and "replica 1" in message
        assert _complete(server, prompts[0]).status_code == 503


def test_a_stopped_replica_makes_health_degraded_not_503_and_comes_back() -> None:
    """A replica that is alive but silent (SIGSTOP) is named unresponsive
    once its ping is older than --health-timeout-s; /health stays 200 while
    the other answers, and is plain 200 again once it answers again."""
    with start_server("tiny", "--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS), "-dp", "2",
                      "--health-timeout-s", "1") as server:
        pids = httpx.get(f"{server.base_url}/server_info").json()["engine_pids"]
        assert httpx.get(f"{server.base_url}/health").status_code == 200
        os.kill(pids[0], signal.SIGSTOP)
        try:
            seen: list[tuple[int, str]] = []

            def degraded() -> bool:
                response = httpx.get(f"{server.base_url}/health", timeout=10)
                seen.append((response.status_code, response.text))
                return response.status_code == 200 and '"degraded"' in response.text

            assert wait_until(degraded, 10.0), seen[-3:]
            assert all(status == 200 for status, _ in seen), seen  # never a 503: replica 1 answers
            replicas = json.loads(seen[-1][1])["replicas"]
            states = [(r["replica"], r["alive"], r["responsive"]) for r in replicas]
            assert states == [(0, True, False), (1, True, True)]
        finally:
            os.kill(pids[0], signal.SIGCONT)
        assert wait_until(lambda: httpx.get(f"{server.base_url}/health").content == b"", 10.0)
