"""The engine-core process and its wire: msgspec messages, the blocking
SyncMPClient against a spawned core, startup failures, and the core's
lifetime (SIGTERM, parent death, a crashing busy loop)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from helpers.tiny_models import cached_tiny_model

from pagedllm import LLM, SamplingParams
from pagedllm.core.config import EngineConfig
from pagedllm.core.errors import EngineDeadError, EngineStartupError, InvalidRequestError
from pagedllm.core.outputs import EngineCoreEvent, EngineCoreOutput
from pagedllm.core.sampling_params import StructuredOutputsParams
from pagedllm.core.scheduler_output import LogprobEntry
from pagedllm.core.stats import SchedulerStats
from pagedllm.engine.core_client import SyncMPClient
from pagedllm.engine.input_processor import make_request
from pagedllm.engine.wire import (
    AddRequests,
    CoreInputDecoder,
    CoreInputEncoder,
    CoreOutputDecoder,
    CoreOutputEncoder,
    EngineCoreOutputs,
    EngineCoreRequest,
    UtilityRequest,
    from_engine_core_request,
)

NUM_KV_BLOCKS = 64
PROMPT_TOKEN_IDS = [[5, 17, 300, 42, 9], [100, 200, 300], [7] * 20]


def _model_path() -> str:
    return str(cached_tiny_model("llama", with_tokenizer=True, seed=1234))


def _config(model: str | None = None) -> EngineConfig:
    return EngineConfig.load(
        model={"model": model or _model_path(), "dtype": "float32"},
        cache={"num_kv_blocks": NUM_KV_BLOCKS},
    )


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


# ------------------------------------------------------------------- wire


def test_engine_core_outputs_survive_the_wire_exactly() -> None:
    output = EngineCoreOutput(
        request_id="r",
        new_token_ids=[3, 4],
        new_logprobs=[LogprobEntry([3, 8], [-0.25, -1.5], 1), LogprobEntry([4], [-0.5], 2)],
        new_prompt_logprobs=[None, LogprobEntry([9, 1], [-2.0, -0.75], 3)],
        finish_reason="stop",
        stop_reason=4,
        num_cached_tokens=16,
        first_scheduled_time=123.5,
        events=[EngineCoreEvent("scheduled", 123.5)],
    )
    stats = SchedulerStats(2, 1, 0.25, 10, 4, 3)
    message = EngineCoreOutputs([output], stats, 37, 200.0)
    decoded = CoreOutputDecoder().decode(CoreOutputEncoder().encode(message))
    assert isinstance(decoded, EngineCoreOutputs)
    assert decoded.outputs == [output]
    assert isinstance(decoded.outputs[0].new_logprobs[0], LogprobEntry)
    assert (decoded.scheduler_stats, decoded.num_scheduled_tokens, decoded.timestamp) == (stats, 37, 200.0)


def test_request_is_rebuilt_with_its_sampling_params_in_the_core() -> None:
    params = SamplingParams(temperature=0.5, top_k=7, seed=3, stop=["x"], stop_token_ids=[2], max_tokens=9)
    request = make_request("r1", None, [1, 2, 3], params, 5.0, priority=-1, cache_salt="s", eos_token_id=2)
    data = CoreInputEncoder().encode(AddRequests(request.engine_requests()))
    message = CoreInputDecoder().decode(data)
    assert isinstance(message, AddRequests)
    rebuilt = from_engine_core_request(message.requests[0])
    assert rebuilt.sampling_params == params
    assert (rebuilt.request_id, rebuilt.prompt_token_ids, rebuilt.eos_token_id) == ("r1", [1, 2, 3], 2)
    assert (rebuilt.arrival_time, rebuilt.priority, rebuilt.cache_salt) == (5.0, -1, "s")


def test_sampling_params_cross_the_core_wire_without_being_validated_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Validated once, where the user's values entered; the core decodes them.
    params = SamplingParams(temperature=0.5, stop=["x"], logit_bias={3: 1.0}, structured_outputs={"regex": "a+"})
    request = make_request("r1", None, [1, 2, 3], params, 5.0, eos_token_id=2)
    data = CoreInputEncoder().encode(AddRequests(request.engine_requests()))

    def refuse(self: object) -> None:
        raise AssertionError("validated again")

    monkeypatch.setattr(SamplingParams, "_verify", refuse)
    monkeypatch.setattr(StructuredOutputsParams, "_verify", refuse)
    message = CoreInputDecoder().decode(data)
    assert isinstance(message, AddRequests)
    assert type(message.requests[0].sampling_params) is SamplingParams
    assert message.requests[0].sampling_params == params


@pytest.mark.parametrize(
    ("changes", "error"),
    [
        ({"max_tokens": "many"}, r"Expected `int \| null`, got `str` - at `\$\[1\]\[0\]\[2\]\.max_tokens`"),
        ({"bogus": 1}, r"Object contains unknown field `bogus` - at `\$\[1\]\[0\]\[2\]`"),
        ({"structured_outputs": {"regexp": "a"}},
         r"unknown field `regexp` - at `\$\[1\]\[0\]\[2\]\.structured_outputs`"),
    ],
)
def test_the_core_wire_decode_checks_sampling_params_types_and_fields(changes: dict, error: str) -> None:
    request = make_request("r1", None, [1, 2, 3], SamplingParams(), 5.0)
    frame = msgspec.msgpack.decode(CoreInputEncoder().encode(AddRequests(request.engine_requests())))
    frame[1][0][2].update(changes)  # ["add", [[request_id, prompt, sampling_params, ...]]]
    with pytest.raises(msgspec.ValidationError, match=error):
        CoreInputDecoder().decode(msgspec.msgpack.encode(frame))


def test_wire_never_carries_pickles() -> None:
    # A msgpack map for "add" that smuggles a non-msgpack object cannot decode.
    wire = EngineCoreRequest("r", [1], SamplingParams(), None, 0.0)
    data = CoreInputEncoder().encode(AddRequests([wire]))
    assert b"\x80\x04" not in data  # no pickle protocol header
    with pytest.raises(msgspec.DecodeError):
        CoreInputDecoder().decode(b"\x80\x04\x95" + data)
    utility = CoreInputDecoder().decode(CoreInputEncoder().encode(UtilityRequest(1, "flush_stats")))
    assert utility == UtilityRequest(1, "flush_stats", [])


# -------------------------------------------------------- spawned core


@pytest.fixture(scope="module")
def client() -> Iterator[SyncMPClient]:
    client = SyncMPClient(_config())
    yield client
    client.shutdown()


def _run(client: SyncMPClient | LLM, params: SamplingParams) -> list[list[int]]:
    if isinstance(client, LLM):
        outputs = client.generate([{"prompt_token_ids": ids} for ids in PROMPT_TOKEN_IDS], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]
    for i, ids in enumerate(PROMPT_TOKEN_IDS):
        client.add_requests(make_request(f"req-{i}", None, ids, params).engine_requests())
    tokens: dict[str, list[int]] = {f"req-{i}": [] for i in range(len(PROMPT_TOKEN_IDS))}
    finished: set[str] = set()
    while len(finished) < len(tokens):
        for output in client.get_output():
            tokens[output.request_id].extend(output.new_token_ids)
            if output.finished:
                finished.add(output.request_id)
    return [tokens[f"req-{i}"] for i in range(len(PROMPT_TOKEN_IDS))]


def test_spawned_core_matches_the_in_process_engine(client: SyncMPClient) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    expected = _run(LLM(model=_model_path(), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS), params)
    assert _run(client, params) == expected
    stats = client.get_stats()
    assert stats is not None
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def test_llm_over_the_multiprocess_client_matches_the_in_process_llm() -> None:
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    # Seeded n > 1: the children's seeds (seed + index) must not depend on the client.
    seeded = SamplingParams(n=2, temperature=1.0, seed=11, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in PROMPT_TOKEN_IDS]
    results = []
    for multiprocess in (False, True):
        llm = LLM(model=_model_path(), dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, multiprocess=multiprocess)
        try:
            assert isinstance(llm.engine_core, SyncMPClient) == multiprocess
            greedy_out = llm.generate(prompts, greedy, use_tqdm=False)
            seeded_out = llm.generate(prompts[:1], seeded, use_tqdm=False)
            results.append((
                [o.outputs[0].token_ids for o in greedy_out],
                [c.token_ids for c in seeded_out[0].outputs],
                llm.max_model_len, llm.eos_token_id,
            ))
            with pytest.raises(InvalidRequestError) as excinfo:
                llm.generate([[1, 10**6]], greedy, use_tqdm=False)
            assert excinfo.value.field == "prompt_token_ids"
        finally:
            llm.shutdown()
    in_process, multiprocess_result = results
    assert multiprocess_result == in_process
    assert len(in_process[0]) == 3 and all(len(ids) == 10 for ids in in_process[0])
    assert in_process[1][0] != in_process[1][1]  # the two seeded samples differ


def test_ready_handshake_reports_the_core(client: SyncMPClient) -> None:
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(_model_path())
    ready = client.ready
    assert ready is not None
    assert (ready.pid, ready.model_path, ready.num_kv_blocks, ready.block_size) == (
        client.engine_pid, _model_path(), NUM_KV_BLOCKS, 16
    )
    assert (ready.max_model_len, ready.vocab_size, ready.eos_token_id) == (
        hf_config.max_position_embeddings, hf_config.vocab_size, hf_config.eos_token_id
    )


def test_abort_in_the_core_frees_blocks_at_once(client: SyncMPClient) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    client.add_requests(make_request("long", None, [1, 2, 3, 4], params).engine_requests())
    while not client.get_output():
        pass
    running = client.get_stats()
    assert running is not None and (running.num_running_reqs, running.num_waiting_reqs) == (1, 0)
    assert running.kv_cache_usage > 0.0  # its blocks (how many depends on how far it ran)
    client.abort_requests(["long"])
    stats = client.get_stats()  # flushed after the abort: same input queue, in order
    assert stats is not None
    assert (stats.num_running_reqs, stats.num_waiting_reqs, stats.kv_cache_usage) == (0, 0, 0.0)


def test_ping_utility_answers_from_the_busy_loop(client: SyncMPClient) -> None:
    assert client.call_utility("ping") == "pong"


def test_memory_usage_utility_reports_the_kv_pages_in_ram(client: SyncMPClient) -> None:
    before = client.call_utility("memory_usage")
    assert [rank["pid"] for rank in before] == [client.engine_pid]  # uni: the rank lives in the core
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    client.add_requests(make_request("touch-kv", None, list(range(1, 100)), params).engine_requests())
    while not any(output.request_id == "touch-kv" and output.finish_reason for output in client.get_output()):
        pass
    (after,) = client.call_utility("memory_usage")
    # The KV cache is a fresh mapping: the pages of blocks written are in RAM (the
    # pool's size is not: earlier tests in this module may have written it all).
    assert before[0]["kv_cache_resident_bytes"] <= after["kv_cache_resident_bytes"] <= after["kv_cache_bytes"]
    assert after["kv_cache_resident_bytes"] > 0


def test_the_cores_start_up_heap_is_out_of_the_collectors_reach(client: SyncMPClient) -> None:
    # A full collection walked 213k start-up objects (torch, the model, the
    # KV block objects): a decode step 100-140 ms late every 15-20 s.
    stats = client.call_utility("gc_stats")
    assert stats["frozen_objects"] > 50_000
    assert stats["tracked_objects"] < stats["frozen_objects"] // 4


def test_unknown_utility_is_refused_and_the_loop_goes_on(client: SyncMPClient) -> None:
    with pytest.raises(RuntimeError, match="UnknownUtility"):
        client.call_utility("__init__")
    assert client.reset_prefix_cache() is True


def test_rejected_request_finishes_as_abort_without_killing_the_core(client: SyncMPClient) -> None:
    # Bypasses the API's validation: an empty prompt reaches the core.
    client.add_requests([EngineCoreRequest("bad", [], SamplingParams(), None, 0.0)])
    # Earlier tests may leave outputs in flight (a step that ran before an abort).
    outputs = []
    while not any(o.request_id == "bad" for o in outputs):
        outputs = client.get_output()
    assert [(o.request_id, o.finish_reason, o.new_token_ids) for o in outputs] == [("bad", "abort", [])]
    client.check_alive()


# ------------------------------------------------------------ lifetime


def test_bad_model_path_fails_startup_with_the_core_error(tmp_path: Path) -> None:
    # The core's own error, not the startup timeout's: it did not wait the timeout out.
    with pytest.raises(EngineStartupError) as excinfo:
        SyncMPClient(_config(model=str(tmp_path / "missing")), startup_timeout_s=60)
    assert excinfo.value.error_type == "ModelLoadError"
    assert "config.json" in str(excinfo.value)


def test_startup_timeout_stops_a_core_that_is_not_ready_in_time() -> None:
    with pytest.raises(EngineStartupError, match=r"not ready after 0\.01 s"):
        SyncMPClient(_config(), startup_timeout_s=0.01)


def test_sigterm_stops_the_core_and_the_client_sees_it_dead() -> None:
    client = SyncMPClient(_config())
    try:
        pid = client.engine_pid
        assert pid is not None
        os.kill(pid, signal.SIGTERM)
        client.resources.process.join(60)  # a hang guard only
        assert client.resources.process.exitcode == 0
        with pytest.raises(EngineDeadError):
            client.check_alive()
    finally:
        client.shutdown()


def test_core_exits_when_its_parent_is_killed(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import os, sys, time
        from pagedllm.engine.core_client import SyncMPClient
        from pagedllm.core.config import EngineConfig
        if __name__ == "__main__":
            config = EngineConfig.load(model={{"model": {_model_path()!r}, "dtype": "float32"}},
                                       cache={{"num_kv_blocks": 16}})
            client = SyncMPClient(config)
            print(client.engine_pid, flush=True)
            time.sleep(600)
        """
    )
    (tmp_path / "parent.py").write_text(script)
    parent = subprocess.Popen([sys.executable, str(tmp_path / "parent.py")], stdout=subprocess.PIPE, text=True)
    try:
        line = parent.stdout.readline() if parent.stdout else ""
        core_pid = int(line)
        os.kill(parent.pid, signal.SIGKILL)  # no atexit, no finalizer: only the core's own watch
        parent.wait(10)
        assert _wait_gone(core_pid, 60.0), "engine core outlived its parent"  # a hang guard only
    finally:
        parent.kill()
        parent.wait()


def test_crash_in_the_busy_loop_is_reported_as_engine_dead(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedllm.core.engine import EngineCore

    def broken_step(self: EngineCore) -> list:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(EngineCore, "step", broken_step)
    client = SyncMPClient(_config(), in_thread=True)  # a thread shares the monkeypatch
    try:
        client.add_requests(make_request("r", None, [1, 2, 3], SamplingParams(max_tokens=2)).engine_requests())
        with pytest.raises(EngineDeadError, match="kernel exploded"):
            client.get_output()
        with pytest.raises(EngineDeadError):
            client.check_alive()
    finally:
        client.shutdown()
