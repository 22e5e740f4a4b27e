"""Encode + decode cost of one step's messages at batch 256, before and after
issue 31's "one type per message".

After: SamplingParams, EngineCoreRequest, SchedulerOutput and
ModelRunnerOutput are msgspec Structs that cross ZMQ and Ray as themselves,
and the receiving side does not validate the params again. Before (kept
below, in this file only): the params went to a dict and were rebuilt and
re-validated (SamplingParams(**dict)) in the engine core and on every rank,
and the step went through field-by-field twins (StepWire, NewRequestWire,
CachedRequestWire, RunnerOutputWire) with the grammar bitmask as bytes.

One step: `--batch` running requests, `--num-new` of them new (their full
SamplingParams travel), the rest decoding; a grammar bitmask for 8 rows; the
runner output with one token per request and top-5 logprobs for 32 of them.
The engine-core request row is `--num-new` requests arriving (API -> core).
Medians over `--repeats` runs; the ratio is before / after.

    .venv/bin/python benchmarks/message_codec.py [--batch 256] [--num-new 32]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec
import torch

from pagedllm.core.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.core.scheduler_output import (
    CachedRequestData,
    KVConnectorOutput,
    LogprobEntry,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.engine.wire import AddRequests, CoreInputDecoder, CoreInputEncoder, EngineCoreRequest
from pagedllm.executors.messages import WorkerInputDecoder, WorkerReply, encode_step, encoder, reply_decoder

VOCAB_SIZE = 32000


def full_params(index: int) -> SamplingParams:
    return SamplingParams(
        temperature=0.7, top_p=0.9, top_k=50, min_p=0.01, presence_penalty=0.5, frequency_penalty=0.25,
        repetition_penalty=1.1, seed=index, max_tokens=256, min_tokens=1, stop=["\n\n", "###"],
        stop_token_ids=[2, 7], logprobs=5, logit_bias={3: 1.5, 10: -2.0}, bad_words=["foo"],
        bad_words_token_ids=[[11, 12]], structured_outputs=StructuredOutputsParams(regex="[a-z]+"),
        extra_args={"tag": "bench"},
    )


def build_step(batch: int, num_new: int) -> SchedulerOutput:
    new = [NewRequestData(f"req-{i}", list(range(100 + i, 612 + i)), full_params(i),
                          list(range(i * 40, i * 40 + 33)), 0, 2) for i in range(num_new)]
    cached = [CachedRequestData(f"req-{i}", [i * 40 + 33] if i % 16 == 0 else [], 600 + i)
              for i in range(num_new, batch)]
    tokens = {r.req_id: 512 for r in new} | {r.req_id: 1 for r in cached}
    return SchedulerOutput(
        new, cached, tokens, sum(tokens.values()),
        structured_output_request_ids=[f"req-{i}" for i in range(8)],
        grammar_bitmask=torch.full((8, (VOCAB_SIZE + 31) // 32), -1, dtype=torch.int32),
        finished_req_ids={"done-1", "done-2"},
    )


def build_output(batch: int) -> ModelRunnerOutput:
    sampled = {f"req-{i}": [1000 + i] for i in range(batch)}
    logprobs = {f"req-{i}": [LogprobEntry([1000 + i, 1, 2, 3, 4, 5], [-0.1, -1.0, -2.0, -3.0, -4.0, -5.0], 1)]
                for i in range(32)}
    return ModelRunnerOutput(sampled, logprobs, kv_connector_output=KVConnectorOutput())


# ------------------------------------------------------- before (copied)


class NewRequestWire(msgspec.Struct, array_like=True):
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    block_ids: list[int]
    num_computed_tokens: int
    eos_token_id: int | None


class CachedRequestWire(msgspec.Struct, array_like=True):
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool


class StepWire(msgspec.Struct, array_like=True):
    scheduled_new_reqs: list[NewRequestWire]
    scheduled_cached_reqs: list[CachedRequestWire]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    structured_output_request_ids: list[str]
    grammar_bitmask: bytes | None
    grammar_bitmask_shape: tuple[int, int] | None
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    kv_connector_metadata: bytes | None = None


class RunnerOutputWire(msgspec.Struct, array_like=True):
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[LogprobEntry]]
    prompt_logprobs: dict[str, list[LogprobEntry | None]]
    spec_token_ids: dict[str, list[int]]
    kv_connector_output: KVConnectorOutput | None = None
    custom_stats: dict[str, float | list[float]] | None = None


class OldEngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: dict[str, Any]
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    group_id: str | None = None
    compiled_grammar: bytes | None = None


def old_params_to_dict(params: SamplingParams) -> dict[str, Any]:
    data = {name: getattr(params, name) for name in params.__struct_fields__}
    so = params.structured_outputs
    if so is not None:
        data["structured_outputs"] = {
            name: json.loads(json.dumps(v)) if isinstance(v, (dict, list)) else v
            for name in so.__struct_fields__ for v in [getattr(so, name)]
        }
    return data


def old_params_from_dict(data: dict[str, Any]) -> SamplingParams:
    unknown = sorted(set(data) - set(SamplingParams.__struct_fields__))
    if unknown:
        raise ValueError(unknown)
    return SamplingParams(**data)  # validated again


def old_step_round_trip(step: SchedulerOutput) -> SchedulerOutput:
    bitmask = step.grammar_bitmask
    wire = StepWire(
        [NewRequestWire(n.req_id, n.prompt_token_ids, old_params_to_dict(n.sampling_params), n.block_ids,
                        n.num_computed_tokens, n.eos_token_id) for n in step.scheduled_new_reqs],
        [CachedRequestWire(c.req_id, c.new_block_ids, c.num_computed_tokens, c.resumed_from_preemption)
         for c in step.scheduled_cached_reqs],
        step.num_scheduled_tokens, step.total_num_scheduled_tokens, step.scheduled_spec_decode_tokens,
        step.structured_output_request_ids,
        None if bitmask is None else bitmask.contiguous().numpy().tobytes(),
        None if bitmask is None else (bitmask.shape[0], bitmask.shape[1]),
        sorted(step.finished_req_ids), sorted(step.preempted_req_ids),
    )
    decoded = OLD_STEP_DECODER.decode(encoder.encode(wire))
    mask = None
    if decoded.grammar_bitmask is not None and decoded.grammar_bitmask_shape is not None:
        mask = torch.frombuffer(bytearray(decoded.grammar_bitmask), dtype=torch.int32).view(
            *decoded.grammar_bitmask_shape)
    return SchedulerOutput(
        [NewRequestData(n.req_id, n.prompt_token_ids, old_params_from_dict(n.sampling_params), n.block_ids,
                        n.num_computed_tokens, n.eos_token_id) for n in decoded.scheduled_new_reqs],
        [CachedRequestData(c.req_id, c.new_block_ids, c.num_computed_tokens, c.resumed_from_preemption)
         for c in decoded.scheduled_cached_reqs],
        decoded.num_scheduled_tokens, decoded.total_num_scheduled_tokens, decoded.scheduled_spec_decode_tokens,
        decoded.structured_output_request_ids, mask, set(decoded.finished_req_ids), set(decoded.preempted_req_ids),
    )


def old_output_round_trip(output: ModelRunnerOutput) -> ModelRunnerOutput:
    wire = RunnerOutputWire(output.sampled_token_ids, output.logprobs, output.prompt_logprobs, output.spec_token_ids,
                            output.kv_connector_output)
    decoded = OLD_OUTPUT_DECODER.decode(encoder.encode(wire))
    return ModelRunnerOutput(decoded.sampled_token_ids, decoded.logprobs, decoded.prompt_logprobs,
                             decoded.spec_token_ids, decoded.kv_connector_output, decoded.custom_stats)


def old_requests_round_trip(requests: list[EngineCoreRequest]) -> list[SamplingParams]:
    wires = [OldEngineCoreRequest(r.request_id, r.prompt_token_ids, old_params_to_dict(r.sampling_params),
                                  r.eos_token_id, r.arrival_time) for r in requests]
    decoded = OLD_REQUESTS_DECODER.decode(encoder.encode(wires))
    return [old_params_from_dict(wire.sampling_params) for wire in decoded]


OLD_STEP_DECODER = msgspec.msgpack.Decoder(StepWire)
OLD_OUTPUT_DECODER = msgspec.msgpack.Decoder(RunnerOutputWire)
OLD_REQUESTS_DECODER = msgspec.msgpack.Decoder(list[OldEngineCoreRequest])

# ------------------------------------------------------- after


def new_step_round_trip(step: SchedulerOutput, decoder: WorkerInputDecoder) -> SchedulerOutput:
    return decoder.decode(encode_step(step)).step  # type: ignore[union-attr]


def new_output_round_trip(output: ModelRunnerOutput) -> ModelRunnerOutput:
    reply = reply_decoder.decode(encoder.encode(WorkerReply(0, "execute_model", output=output)))
    assert reply.output is not None
    return reply.output


def median_us(run: Callable[[], object], repeats: int) -> float:
    run()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--num-new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    step, output = build_step(args.batch, args.num_new), build_output(args.batch)
    requests = [EngineCoreRequest(f"req-{i}", list(range(512)), full_params(i), 2, 0.0) for i in range(args.num_new)]
    core_encoder, core_decoder, rank_decoder = CoreInputEncoder(), CoreInputDecoder(), WorkerInputDecoder()
    # Both paths carry the same values.
    assert new_step_round_trip(step, rank_decoder).scheduled_new_reqs == old_step_round_trip(step).scheduled_new_reqs
    assert [r.sampling_params for r in core_decoder.decode(core_encoder.encode(AddRequests(requests))).requests] \
        == old_requests_round_trip(requests)  # type: ignore[union-attr]
    rows = [
        (f"engine-core requests x{args.num_new} (API -> core)",
         lambda: old_requests_round_trip(requests),
         lambda: core_decoder.decode(core_encoder.encode(AddRequests(requests)))),
        (f"scheduler output, batch {args.batch}, {args.num_new} new (executor -> rank)",
         lambda: old_step_round_trip(step), lambda: new_step_round_trip(step, rank_decoder)),
        (f"model-runner output, batch {args.batch} (rank -> executor)",
         lambda: old_output_round_trip(output), lambda: new_output_round_trip(output)),
    ]
    print(f"{'message (encode + decode)':<58} {'before us':>10} {'after us':>10} {'ratio':>7}")
    total_before = total_after = 0.0
    for name, before, after in rows:
        before_us, after_us = median_us(before, args.repeats), median_us(after, args.repeats)
        total_before, total_after = total_before + before_us, total_after + after_us
        print(f"{name:<58} {before_us:>10.1f} {after_us:>10.1f} {before_us / after_us:>6.2f}x")
    print(f"{'one step (the three above)':<58} {total_before:>10.1f} {total_after:>10.1f} "
          f"{total_before / total_after:>6.2f}x")


if __name__ == "__main__":
    main()
