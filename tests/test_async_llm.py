"""AsyncLLM end to end on a tiny random Llama, with the engine core in a
thread (in_process) and in its own spawned process (ZMQ + msgspec).

The reference is the offline `LLM.generate` on the same model and config,
computed in the same run.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineUnresponsiveError,
    InvalidRequestError,
    ServerShuttingDownError,
)
from pagedllm.core.stats import SchedulerStats
from pagedllm.engine.async_llm import AsyncLLM
from pagedllm.engine.outputs import RequestOutput, RequestOutputKind

pytestmark = pytest.mark.asyncio(loop_scope="module")

NUM_KV_BLOCKS = 64
BLOCK_SIZE = 16
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "1 2 3 4"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _model_path() -> str:
    return str(cached_tiny_model("llama", with_tokenizer=True, seed=1234))


def _config(**server: Any) -> EngineConfig:
    return EngineConfig.load(
        model={"model": _model_path(), "dtype": "float32"},
        cache={"num_kv_blocks": NUM_KV_BLOCKS, "block_size": BLOCK_SIZE},
        server={"log_stats_interval_s": 0.0, **server},
    )


@pytest.fixture(scope="module", autouse=True)
def _check_block_invariant_every_step() -> Iterator[None]:
    # Module scope (monkeypatch is per test); the spawned core inherits it.
    previous = os.environ.get("PAGEDLLM_DEBUG_KV")
    os.environ["PAGEDLLM_DEBUG_KV"] = "1"
    yield
    if previous is None:
        os.environ.pop("PAGEDLLM_DEBUG_KV", None)
    else:
        os.environ["PAGEDLLM_DEBUG_KV"] = previous


@pytest.fixture(scope="module")
def offline_llm() -> LLM:
    return LLM(model=_model_path(), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, block_size=BLOCK_SIZE)


@pytest.fixture(scope="module")
def reference(offline_llm: LLM) -> list[RequestOutput]:
    return offline_llm.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module", params=["in_process", "multiprocess"])
def engine(request: pytest.FixtureRequest) -> Iterator[AsyncLLM]:
    llm = AsyncLLM(_config(), in_process=request.param == "in_process")
    yield llm
    llm.shutdown()


async def _collect(llm: AsyncLLM, prompt: str | list[int], params: SamplingParams, request_id: str,
                   **kwargs: Any) -> list[RequestOutput]:
    return [output async for output in llm.generate(prompt, params, request_id, **kwargs)]


def _queues(stats: SchedulerStats | None) -> tuple[int, int, float] | None:
    """(running, waiting, KV cache usage); IDLE when every block is free."""
    return None if stats is None else (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage)


IDLE = (0, 0, 0.0)


async def _wait_until_idle(llm: AsyncLLM, timeout_s: float = 60.0) -> SchedulerStats | None:
    """The stats once idle; `timeout_s` only guards against a hang."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = await llm.get_stats()
        if _queues(stats) == IDLE or time.monotonic() > deadline:
            return stats
        await asyncio.sleep(0.01)


async def test_concurrent_greedy_outputs_equal_offline_generate(
    engine: AsyncLLM, reference: list[RequestOutput]
) -> None:
    results = await asyncio.gather(
        *(
            _collect(engine, prompt, GREEDY, f"greedy-{i}", output_kind=RequestOutputKind.FINAL_ONLY)
            for i, prompt in enumerate(PROMPTS)
        )
    )
    for outputs, expected in zip(results, reference, strict=True):
        assert len(outputs) == 1 and outputs[0].finished
        assert outputs[0].prompt_token_ids == expected.prompt_token_ids
        assert outputs[0].outputs[0].token_ids == expected.outputs[0].token_ids
        assert outputs[0].outputs[0].text == expected.outputs[0].text
        assert outputs[0].outputs[0].finish_reason == "length"


async def test_streamed_deltas_concatenate_to_the_final_text(
    engine: AsyncLLM, reference: list[RequestOutput]
) -> None:
    outputs = await _collect(engine, PROMPTS[2], GREEDY, "stream-0")
    assert len(outputs) == GREEDY.max_tokens  # one delta per decode step
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert "".join(o.outputs[0].text for o in outputs) == reference[2].outputs[0].text
    assert [t for o in outputs for t in o.outputs[0].token_ids] == reference[2].outputs[0].token_ids


async def test_token_id_prompt_with_n_2_fans_out_and_back(
    engine: AsyncLLM, offline_llm: LLM, reference: list[RequestOutput]
) -> None:
    token_ids = reference[0].prompt_token_ids
    params = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=6, ignore_eos=True)
    expected = offline_llm.generate([token_ids], params, use_tqdm=False)[0]
    outputs = await _collect(engine, token_ids, params, "n2", output_kind=RequestOutputKind.FINAL_ONLY)
    assert len(outputs) == 1 and outputs[0].request_id == "n2"
    got = sorted(outputs[0].outputs, key=lambda c: c.index)
    assert [c.index for c in got] == [0, 1]
    assert [c.token_ids for c in got] == [c.token_ids for c in sorted(expected.outputs, key=lambda c: c.index)]
    stats = await _wait_until_idle(engine)
    assert _queues(stats) == IDLE


async def test_consumer_that_stops_early_aborts_and_frees_every_block(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    generator = engine.generate(PROMPTS[1], params, "dropped")
    received = 0
    async for _ in generator:
        received += 1
        if received == 2:
            break
    await generator.aclose()  # what Starlette's cancellation amounts to
    assert engine.num_unfinished_requests == 0
    stats = await _wait_until_idle(engine)
    assert _queues(stats) == IDLE


async def test_cancelled_consumer_task_aborts_its_request(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    started = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate(PROMPTS[0], params, "cancelled"):
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), 60)  # a hang guard only
    task.cancel()  # a client disconnect in the HTTP server
    with pytest.raises(asyncio.CancelledError):
        await task
    stats = await _wait_until_idle(engine)
    assert _queues(stats) == IDLE


async def test_explicit_abort_ends_the_stream_with_finish_reason_abort(engine: AsyncLLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    outputs = []
    async for output in engine.generate(PROMPTS[3], params, "aborted"):
        outputs.append(output)
        if len(outputs) == 1:
            await engine.abort("aborted")
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    stats = await _wait_until_idle(engine)
    assert _queues(stats) == IDLE


async def test_stop_string_ends_the_request_here_and_in_the_core(
    engine: AsyncLLM, reference: list[RequestOutput]
) -> None:
    full_text = reference[1].outputs[0].text
    stop = full_text[len(full_text) // 2 :].strip()[:3]
    assert stop, full_text
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=[stop])
    outputs = await _collect(engine, PROMPTS[1], params, "stop", output_kind=RequestOutputKind.FINAL_ONLY)
    completion = outputs[-1].outputs[0]
    assert completion.text == full_text[: full_text.index(stop)]
    assert (completion.finish_reason, completion.stop_reason) == ("stop", stop)
    stats = await _wait_until_idle(engine)
    assert _queues(stats) == IDLE


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ([], SamplingParams(), "prompt"),
        ([1] * 1024, SamplingParams(), "prompt"),
        ([1, 10**6], SamplingParams(), "prompt_token_ids"),
        ("Hello", SamplingParams(max_tokens=10**6), "max_tokens"),
        ([1, "x"], SamplingParams(), "prompt_token_ids"),
    ],
)
async def test_invalid_request_is_rejected_before_it_reaches_the_core(
    engine: AsyncLLM, offline_llm: LLM, prompt: Any, params: SamplingParams, field: str
) -> None:
    with pytest.raises(InvalidRequestError) as excinfo:
        await _collect(engine, prompt, params, "invalid")
    assert excinfo.value.field == field
    assert engine.num_unfinished_requests == 0
    assert _queues(await engine.get_stats())[:2] == (0, 0)
    # One input processor: the offline LLM refuses it with the very same error.
    with pytest.raises(InvalidRequestError) as offline:
        offline_llm.generate([prompt], params, use_tqdm=False)
    assert str(offline.value) == str(excinfo.value)


async def test_reset_prefix_cache_and_health_of_a_live_engine(engine: AsyncLLM) -> None:
    await engine.check_health()
    assert not engine.errored
    assert await engine.reset_prefix_cache() is True
    assert engine.max_model_len == 512 and engine.vocab_size == engine.tokenizer.vocab_size
    assert (engine.engine_pid is None) == (engine.engine_core.resources.process is None)


async def test_requests_beyond_max_pending_requests_are_refused() -> None:
    llm = AsyncLLM(_config(max_pending_requests=2), in_process=True)
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    try:
        running = [llm.generate(PROMPTS[i], params, f"pending-{i}") for i in range(2)]
        for generator in running:
            await generator.__anext__()
        with pytest.raises(EngineOverloadedError) as excinfo:
            await _collect(llm, PROMPTS[2], params, "pending-2")
        assert (excinfo.value.num_pending, excinfo.value.limit) == (2, 2)
        for generator in running:
            await generator.aclose()
        # Room again once they are gone.
        outputs = await _collect(llm, PROMPTS[2], SamplingParams(max_tokens=2), "pending-3")
        assert outputs[-1].finished
    finally:
        llm.shutdown()


async def test_admission_counts_prompts_times_n_and_refuses_a_request_too_big_alone() -> None:
    # Every sequence counted (no per-request share): the exact arithmetic.
    llm = AsyncLLM(_config(max_pending_requests=8, max_pending_share=1.0), in_process=True)
    params = SamplingParams(n=3, temperature=0.0, max_tokens=400, ignore_eos=True)
    try:
        with pytest.raises(InvalidRequestError) as too_many_samples:
            llm.admit(3, 3)
        assert (too_many_samples.value.field, too_many_samples.value.value) == ("n", 3)
        assert "= 9 sequences" in str(too_many_samples.value)
        assert "(server.max_pending_requests = 8)" in str(too_many_samples.value)
        with pytest.raises(InvalidRequestError) as too_many_prompts:
            llm.admit(9, 1)
        assert (too_many_prompts.value.field, too_many_prompts.value.value) == ("prompt", 9)

        admission = llm.admit(2, 3)
        assert llm.num_pending_sequences == 6  # reserved before any prompt reached the engine
        with pytest.raises(EngineOverloadedError) as overloaded:
            llm.admit(1, 3)
        assert (overloaded.value.num_pending, overloaded.value.num_requested, overloaded.value.limit) == (6, 3, 8)
        running = [llm.generate(PROMPTS[i], params, f"admitted-{i}", admission=admission) for i in range(2)]
        for generator in running:
            await generator.__anext__()
        assert (admission.num_reserved, llm.num_pending_sequences) == (0, 6)
        # Without an admission, generate() counts its own n.
        with pytest.raises(EngineOverloadedError):
            await _collect(llm, PROMPTS[2], params, "unadmitted")
        unused = llm.admit(1, 2)
        assert llm.num_pending_sequences == 8
        del unused  # a handler that never started its prompts: the reservation goes with it
        assert llm.num_pending_sequences == 6
        for generator in running:
            await generator.aclose()
        assert llm.num_pending_sequences == 0
        with pytest.raises(InvalidRequestError) as alone:
            await _collect(llm, PROMPTS[0], SamplingParams(n=9), "too-big")
        assert alone.value.field == "n"
    finally:
        llm.shutdown()


async def test_a_request_counts_for_at_most_its_share_of_the_pending_limit() -> None:
    # 8 pending sequences, half of them for one request at most.
    llm = AsyncLLM(_config(max_pending_requests=8, max_pending_share=0.5), in_process=True)
    params = SamplingParams(n=4, temperature=0.0, max_tokens=400, ignore_eos=True)
    try:
        big = llm.admit(2, 4)  # at the limit: accepted, counted as 4
        assert (llm.num_pending_sequences, llm.num_counted_pending_sequences) == (8, 4)
        running = [llm.generate(PROMPTS[i], params, f"big-{i}", admission=big) for i in range(2)]
        for generator in running:
            await generator.__anext__()
        # Another client still gets in beside it (FCFS counting refused it: 8 + 1 > 8).
        outputs = await _collect(llm, PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=2), "small")
        assert outputs[-1].outputs[0].finish_reason == "length"
        assert sum(len(output.outputs[0].token_ids) for output in outputs) == 2
        second = llm.admit(1, 4)
        assert (llm.num_pending_sequences, llm.num_counted_pending_sequences) == (12, 8)
        with pytest.raises(EngineOverloadedError) as overloaded:
            llm.admit(1, 1)
        assert (overloaded.value.num_pending, overloaded.value.num_requested, overloaded.value.limit) == (8, 1, 8)
        del second
        for generator in running:
            await generator.aclose()
        assert llm.num_pending_sequences == 0
    finally:
        llm.shutdown()


def _finish_counts(llm: AsyncLLM) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        sample.labels["finished_reason"]: sample.value
        for family in text_string_to_metric_families(llm.stat_logger.render().decode())
        for sample in family.samples
        if sample.name == "pagedllm:request_success_total"
    }


async def test_every_abort_is_counted_once_and_a_stop_string_is_a_stop(reference: list[RequestOutput]) -> None:
    llm = AsyncLLM(_config(), in_process=True)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    try:
        dropped = llm.generate(PROMPTS[0], long, "dropped")  # a client that disconnects
        await dropped.__anext__()
        await dropped.aclose()
        async for _ in llm.generate(PROMPTS[1], long, "aborted"):
            await llm.abort("aborted")
        n2 = llm.generate(PROMPTS[2], SamplingParams(n=2, max_tokens=400, ignore_eos=True), "n2")
        await n2.__anext__()
        await n2.aclose()  # both samples end by abort
        full_text = reference[1].outputs[0].text
        stop = full_text[len(full_text) // 2 :].strip()[:3]
        stopped = await _collect(llm, PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                                 stop=[stop]), "stop")
        assert stopped[-1].outputs[0].finish_reason == "stop"
        assert _finish_counts(llm) == {"abort": 4, "stop": 1, "length": 0}
    finally:
        llm.shutdown()


async def test_end_all_requests_fails_those_in_flight_and_refuses_new_ones() -> None:
    llm = AsyncLLM(_config(), in_process=True)
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    try:
        in_flight = llm.generate(PROMPTS[0], long, "in-flight")
        await in_flight.__anext__()
        assert llm.end_all_requests("the server is shutting down") == 1
        with pytest.raises(ServerShuttingDownError, match="the server is shutting down"):
            async for _ in in_flight:
                pass
        with pytest.raises(ServerShuttingDownError):
            await _collect(llm, PROMPTS[1], long, "too-late")
        with pytest.raises(ServerShuttingDownError):
            llm.admit(1, 1)
        assert _finish_counts(llm)["abort"] == 1
        stats = await _wait_until_idle(llm)  # the core let go of it too
        assert _queues(stats) == IDLE
    finally:
        llm.shutdown()


async def test_health_check_fails_within_its_timeout_while_the_core_is_stopped() -> None:
    timeout_s = 0.5
    llm = AsyncLLM(_config(health_timeout_s=timeout_s), in_process=False)
    pid = llm.engine_pid
    assert pid is not None
    try:
        await llm.check_health()
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped_at = time.monotonic()
            while True:  # polled like a load balancer would
                results = await asyncio.gather(*(llm.check_health() for _ in range(3)), return_exceptions=True)
                if any(results):
                    break
                assert time.monotonic() - stopped_at < 60.0  # a hang guard only
                await asyncio.sleep(0.05)
            failed_after = time.monotonic() - stopped_at
            assert [type(result) for result in results] == [EngineUnresponsiveError] * 3
            # The core was heard from just before the stop: no sooner than one timeout.
            assert failed_after >= timeout_s - 0.05
            assert len(llm.engine_core._utility_futures) == 1  # every check shared one ping
            # That ping is overdue: a check now fails at once, sending no new ping.
            with pytest.raises(EngineUnresponsiveError, match=r"server\.health_timeout_s"):
                await llm.check_health()
            assert len(llm.engine_core._utility_futures) == 1
        finally:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + 60.0  # a hang guard only
        while True:  # healthy again once the core answered the overdue ping
            try:
                await llm.check_health()
                break
            except EngineUnresponsiveError:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        assert not llm.errored
    finally:
        llm.shutdown()


async def test_stat_logger_counts_the_tokens_of_each_request(reference: list[RequestOutput]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    llm = AsyncLLM(_config(), in_process=True)
    try:
        for i in range(2):
            await _collect(llm, PROMPTS[i], GREEDY, f"metrics-{i}")
        samples = {
            sample.name: sample.value
            for family in text_string_to_metric_families(llm.stat_logger.render().decode())
            for sample in family.samples
        }
        assert samples["pagedllm:generation_tokens_total"] == 2 * GREEDY.max_tokens
        assert samples["pagedllm:prompt_tokens_total"] == sum(len(r.prompt_token_ids) for r in reference[:2])
        assert samples["pagedllm:num_requests_running"] == 0
    finally:
        llm.shutdown()


async def test_killed_engine_core_fails_in_flight_requests_and_health() -> None:
    llm = AsyncLLM(_config(), in_process=False)
    try:
        pid = llm.engine_pid
        assert pid is not None
        params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        generator = llm.generate(PROMPTS[0], params, "in-flight")
        await generator.__anext__()
        os.kill(pid, signal.SIGKILL)
        async with asyncio.timeout(60):  # a hang guard only
            with pytest.raises(EngineDeadError):
                async for _ in generator:
                    pass
        with pytest.raises(EngineDeadError):
            await llm.check_health()
        assert llm.errored
        with pytest.raises(EngineDeadError):
            await _collect(llm, PROMPTS[1], params, "after-death")
    finally:
        llm.shutdown()
    assert llm.engine_core.resources.process.exitcode == -signal.SIGKILL


async def test_shutdown_stops_the_core_process_and_fails_in_flight_requests() -> None:
    import multiprocessing

    llm = AsyncLLM(_config(), in_process=False)
    pid = llm.engine_pid
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    generator = llm.generate(PROMPTS[0], params, "in-flight")
    await generator.__anext__()
    llm.shutdown()
    # Exit code 0 below: the Shutdown message sufficed, no SIGTERM / SIGKILL fallback was needed.
    with pytest.raises(EngineDeadError):
        async for _ in generator:
            pass
    assert llm.engine_core.resources.process.exitcode == 0  # the Shutdown message, not a signal
    assert pid not in [child.pid for child in multiprocessing.active_children()]
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
