"""Messages between a multi-rank executor and its workers (msgspec).

The executor sends every rank the same frames: `InitWorker` once, then
`ExecuteModel` (one step's SchedulerOutput) and `CallWorker` (a utility
call, by Worker method name). Each rank answers with a `WorkerReply`; for a
step the output rank (0) sends the ModelRunnerOutput, the others answer only
when the step failed or a KV connector reports (below). Everything is msgpack
of the structs below: nothing is pickled, so no frame can run code in a worker.

SchedulerOutput travels as `StepWire`: its SamplingParams as plain values
(rebuilt and re-validated on the rank, engine/wire.py), the grammar bitmask
as raw int32 bytes with its shape, a KV connector's metadata as msgpack of
its dataclass (decoded on the rank into the connector's `metadata_cls`).
With a KV connector every rank answers a step: its connector's report
(`KVConnectorOutput`) rides in its RunnerOutputWire.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import msgspec
import torch

from pagedllm.core.custom_stats import FigureValue
from pagedllm.core.errors import ConfigError
from pagedllm.core.scheduler_output import (
    CachedRequestData,
    KVConnectorMetadata,
    KVConnectorOutput,
    LogprobEntry,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedllm.engine.wire import sampling_params_from_dict, sampling_params_to_dict
from pagedllm.executors.base import RankFailedError


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
    """SchedulerOutput on the wire, field for field."""

    scheduled_new_reqs: list[NewRequestWire]
    scheduled_cached_reqs: list[CachedRequestWire]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    scheduled_spec_decode_tokens: dict[str, list[int]]
    structured_output_request_ids: list[str]
    # int32 rows of the grammar bitmask, row-major; shape [rows, words].
    grammar_bitmask: bytes | None
    grammar_bitmask_shape: tuple[int, int] | None
    finished_req_ids: list[str]
    preempted_req_ids: list[str]
    # msgpack of the connector's metadata dataclass (None without a connector).
    kv_connector_metadata: bytes | None = None


class RunnerOutputWire(msgspec.Struct, array_like=True):
    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[LogprobEntry]]
    prompt_logprobs: dict[str, list[LogprobEntry | None]]
    spec_token_ids: dict[str, list[int]]
    kv_connector_output: KVConnectorOutput | None = None
    # The rank's custom figures this step (core/custom_stats.py), if it has any.
    custom_stats: dict[str, FigureValue] | None = None


# ------------------------------------------------------- executor -> rank


class InitWorker(msgspec.Struct, tag="init", array_like=True):
    """Become rank `rank` of `world_size` (the first frame a rank gets)."""

    config_json: str  # EngineConfig.model_dump_json()
    rank: int
    local_rank: int
    world_size: int
    distributed_init_method: str


class CallWorker(msgspec.Struct, tag="call", array_like=True):
    # NOTE: the rank checks `method` against Executor.RPC_METHODS before it runs it.
    method: str
    args: list[Any] = []


class ExecuteModel(msgspec.Struct, tag="step", array_like=True):
    step: StepWire


WorkerInput = InitWorker | CallWorker | ExecuteModel

# ------------------------------------------------------- rank -> executor


class WorkerReply(msgspec.Struct, tag="reply", array_like=True):
    """One rank's answer to one frame: a value, a step's output, or an error."""

    rank: int
    method: str
    value: Any = None
    output: RunnerOutputWire | None = None
    # "ExceptionType: message" when the call raised on this rank.
    error: str | None = None
    # [key, value, allowed] when it raised a ConfigError (the user's to fix,
    # so the executor raises it as one; value as str when not plain).
    config_error: list[Any] | None = None


def raise_reply_error(reply: WorkerReply, fail: Callable[[RankFailedError], RankFailedError]) -> NoReturn:
    """Raise what an error reply means: the rank's ConfigError as one (the
    user's to fix: a budget below one block on a rank), else the
    RankFailedError naming the rank that `fail` settles on (the executor's
    `_blame`: a peer found dead meanwhile is named instead). Either way the
    executor has failed."""
    failure = fail(RankFailedError(reply.rank, f"{reply.method}: {reply.error}"))
    if reply.config_error is not None:
        key, value, allowed = reply.config_error
        raise ConfigError(key, value, allowed)
    raise failure


# ------------------------------------------------------------- conversions


def step_to_wire(scheduler_output: SchedulerOutput) -> StepWire:
    bitmask = scheduler_output.grammar_bitmask
    return StepWire(
        scheduled_new_reqs=[
            NewRequestWire(
                new.req_id,
                new.prompt_token_ids,
                sampling_params_to_dict(new.sampling_params),
                new.block_ids,
                new.num_computed_tokens,
                new.eos_token_id,
            )
            for new in scheduler_output.scheduled_new_reqs
        ],
        scheduled_cached_reqs=[
            CachedRequestWire(c.req_id, c.new_block_ids, c.num_computed_tokens, c.resumed_from_preemption)
            for c in scheduler_output.scheduled_cached_reqs
        ],
        num_scheduled_tokens=scheduler_output.num_scheduled_tokens,
        total_num_scheduled_tokens=scheduler_output.total_num_scheduled_tokens,
        scheduled_spec_decode_tokens=scheduler_output.scheduled_spec_decode_tokens,
        structured_output_request_ids=scheduler_output.structured_output_request_ids,
        grammar_bitmask=None if bitmask is None else bitmask.contiguous().numpy().tobytes(),
        grammar_bitmask_shape=None if bitmask is None else (bitmask.shape[0], bitmask.shape[1]),
        finished_req_ids=sorted(scheduler_output.finished_req_ids),
        preempted_req_ids=sorted(scheduler_output.preempted_req_ids),
        kv_connector_metadata=_encode_connector_metadata(scheduler_output.kv_connector_metadata),
    )


def _encode_connector_metadata(metadata: KVConnectorMetadata | None) -> bytes | None:
    if metadata is None:
        return None
    try:
        return encoder.encode(metadata)
    except TypeError as exc:
        raise TypeError(
            f"KV connector metadata {type(metadata).__name__} cannot be sent to the ranks ({exc}): at "
            "tensor_parallel_size > 1 it must be plain data (block ids, hashes, numbers, strings), no tensors"
        ) from None


def step_from_wire(wire: StepWire, metadata_cls: type[KVConnectorMetadata] | None = None) -> SchedulerOutput:
    """The step `wire` carries; its KV connector metadata decoded into
    `metadata_cls` (this rank's connector's)."""
    bitmask = None
    if wire.grammar_bitmask is not None and wire.grammar_bitmask_shape is not None:
        # bytearray: a writable buffer, so the tensor owns its memory.
        bitmask = torch.frombuffer(bytearray(wire.grammar_bitmask), dtype=torch.int32).view(
            *wire.grammar_bitmask_shape
        )
    return SchedulerOutput(
        scheduled_new_reqs=[
            NewRequestData(
                new.req_id,
                new.prompt_token_ids,
                sampling_params_from_dict(new.sampling_params),
                new.block_ids,
                new.num_computed_tokens,
                new.eos_token_id,
            )
            for new in wire.scheduled_new_reqs
        ],
        scheduled_cached_reqs=[
            CachedRequestData(c.req_id, c.new_block_ids, c.num_computed_tokens, c.resumed_from_preemption)
            for c in wire.scheduled_cached_reqs
        ],
        num_scheduled_tokens=wire.num_scheduled_tokens,
        total_num_scheduled_tokens=wire.total_num_scheduled_tokens,
        scheduled_spec_decode_tokens=wire.scheduled_spec_decode_tokens,
        structured_output_request_ids=wire.structured_output_request_ids,
        grammar_bitmask=bitmask,
        finished_req_ids=set(wire.finished_req_ids),
        preempted_req_ids=set(wire.preempted_req_ids),
        kv_connector_metadata=_decode_connector_metadata(wire.kv_connector_metadata, metadata_cls),
    )


def _decode_connector_metadata(
    data: bytes | None, metadata_cls: type[KVConnectorMetadata] | None
) -> KVConnectorMetadata | None:
    if data is None:
        return None
    if metadata_cls is None:
        raise RuntimeError("a step carries KV connector metadata, but this rank has no KV connector")
    return msgspec.msgpack.decode(data, type=metadata_cls)


def runner_output_to_wire(output: ModelRunnerOutput) -> RunnerOutputWire:
    return RunnerOutputWire(
        output.sampled_token_ids, output.logprobs, output.prompt_logprobs, output.spec_token_ids,
        output.kv_connector_output, output.custom_stats,
    )


def kv_report_to_wire(output: ModelRunnerOutput) -> RunnerOutputWire:
    """A rank's answer to a step besides the output rank's: its KV connector's
    report and its custom figures only."""
    return RunnerOutputWire({}, {}, {}, {}, output.kv_connector_output, output.custom_stats)


def runner_output_from_wire(wire: RunnerOutputWire) -> ModelRunnerOutput:
    return ModelRunnerOutput(
        wire.sampled_token_ids, wire.logprobs, wire.prompt_logprobs, wire.spec_token_ids, wire.kv_connector_output,
        wire.custom_stats,
    )


encoder = msgspec.msgpack.Encoder()
input_decoder = msgspec.msgpack.Decoder(WorkerInput)
reply_decoder = msgspec.msgpack.Decoder(WorkerReply)

__all__ = [
    "CallWorker",
    "ExecuteModel",
    "InitWorker",
    "StepWire",
    "WorkerInput",
    "WorkerReply",
    "encoder",
    "input_decoder",
    "kv_report_to_wire",
    "raise_reply_error",
    "reply_decoder",
    "runner_output_from_wire",
    "runner_output_to_wire",
    "step_from_wire",
    "step_to_wire",
]
