"""One type per message: a SamplingParams with every field set reaches a rank
of the `mp` and of the `ray` executor equal to the one the API built, with no
conversion code in between (it crosses the engine core's ZMQ socket and the
executor's frames as itself). A logits processor of the test plugin
(`record_params`, tests/plugins) writes down what each rank received."""

from __future__ import annotations

import os

# NOTE: before Ray is imported anywhere: Ray then binds 127.0.0.1 only (no
# traffic leaves the machine) and sends no usage report.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.core.sampling_params import StructuredOutputsParams
from pagedllm.core.scheduler_output import ModelRunnerOutput, NewRequestData, SchedulerOutput
from pagedllm.engine.wire import EngineCoreRequest
from pagedllm.executors.messages import ExecuteModel, WorkerInputDecoder, WorkerReply, encode_step
from pagedllm.plugins import get_plugin_manager

NUM_KV_BLOCKS = 64
PROMPT = [1, 5, 9, 13, 2, 7]


def _every_field_set(record_path: Path) -> dict[str, Any]:
    """A value different from the default for every SamplingParams field."""
    return {
        "n": 2,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "min_p": 0.01,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
        "repetition_penalty": 1.1,
        "seed": 1234,
        "max_tokens": 3,
        "min_tokens": 1,
        "stop": ["zzzz"],
        "stop_token_ids": [7],
        "ignore_eos": True,
        "include_stop_str_in_output": True,
        "logprobs": 2,
        "prompt_logprobs": 1,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
        "detokenize": False,
        "structured_outputs": StructuredOutputsParams(regex="[a-z ]{1,8}", disable_any_whitespace=True,
                                                      max_whitespace=2),
        "extra_args": {"record_params_to": str(record_path)},
        "logit_bias": {3: 1.5, 10: -2.0},
        "allowed_token_ids": list(range(256)),
        "bad_words": ["qqqq"],
        "bad_words_token_ids": [[4, 4]],
        "logprob_token_ids": [1, 2],
        "truncate_prompt_tokens": 5,
        "truncation_side": "right",
    }


def test_every_field_has_a_value_that_is_not_its_default(tmp_path: Path) -> None:
    values = _every_field_set(tmp_path / "unused")
    # A new SamplingParams field fails here until the test sets it too.
    assert sorted(values) == sorted(SamplingParams.__struct_fields__)
    default = SamplingParams()
    assert [name for name in values if getattr(SamplingParams(**values), name) == getattr(default, name)] == []


def _field_type(struct: type[msgspec.Struct], name: str) -> Any:
    return next(field.type for field in msgspec.structs.fields(struct) if field.name == name)


def test_the_messages_that_cross_processes_carry_the_core_types_themselves() -> None:
    # No dict or wire twin between the API, the engine core and the ranks.
    assert _field_type(EngineCoreRequest, "sampling_params") is SamplingParams
    assert _field_type(ExecuteModel, "step") is SchedulerOutput
    assert _field_type(NewRequestData, "sampling_params") is SamplingParams
    assert _field_type(WorkerReply, "output") == ModelRunnerOutput | None


def test_a_rank_decodes_the_step_as_sent_without_validating_the_params_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    params = SamplingParams(**_every_field_set(tmp_path / "unused"))
    bitmask = torch.arange(-6, 6, dtype=torch.int32).view(2, 6)
    step = SchedulerOutput(
        [NewRequestData("a", [1, 2, 3], params, [4, 5], 0, 2)], [], {"a": 3}, 3,
        structured_output_request_ids=["a"], grammar_bitmask=bitmask, finished_req_ids={"z"},
    )
    frame = encode_step(step)

    def refuse(self: object) -> None:
        raise AssertionError("validated again")

    monkeypatch.setattr(SamplingParams, "_verify", refuse)
    monkeypatch.setattr(StructuredOutputsParams, "_verify", refuse)
    message = WorkerInputDecoder().decode(frame)
    assert isinstance(message, ExecuteModel)
    received = message.step
    assert received.grammar_bitmask is not None and torch.equal(received.grammar_bitmask, bitmask)
    received.grammar_bitmask = step.grammar_bitmask = None
    assert received == step


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mp", "ray"])
def test_sampling_params_with_every_field_reach_each_rank_as_the_api_built_them(
    backend: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    record = tmp_path / "params.jsonl"
    params = SamplingParams(**_every_field_set(record))
    llm = LLM("tiny", tensor_parallel_size=2, distributed_executor_backend=backend, num_kv_blocks=NUM_KV_BLOCKS,
              logits_processors=["record_params"])
    try:
        [output] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    finally:
        llm.shutdown()
        get_plugin_manager().load(config={})
    assert len(output.outputs) == 2
    lines = [msgspec.json.decode(line) for line in record.read_bytes().splitlines()]
    # The API's n=2 request is two engine requests: its two children.
    built = [params.for_child(0), params.for_child(1)]
    received = {(line["pid"], line["type"], msgspec.json.encode(line["params"])) for line in lines}
    pids = {pid for pid, _, _ in received}
    assert len(pids) == 2 and os.getpid() not in pids  # both ranks, neither in this process
    assert {type_name for _, type_name, _ in received} == {"pagedllm.core.sampling_params.SamplingParams"}
    for pid in pids:
        got = [msgspec.json.decode(data, type=SamplingParams) for rank_pid, _, data in received if rank_pid == pid]
        assert sorted(got, key=lambda p: p.seed or 0) == built
