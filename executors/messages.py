"""Messages between a multi-rank executor and its workers (msgspec).

The executor sends every rank the same frames: `InitWorker` once, then
`ExecuteModel` (one step's SchedulerOutput) and `CallWorker` (a utility
call, by Worker method name). Each rank answers with a `WorkerReply`; for a
step the output rank (0) sends the ModelRunnerOutput, the others answer only
when the step failed or a KV connector reports (below). Everything is msgpack
of typed structs: nothing is pickled, so no frame can run code in a worker.

The SchedulerOutput and the ModelRunnerOutput travel as themselves (msgspec
Structs, core/scheduler_output.py), with their SamplingParams: validated where
the user's values entered, decoded on the rank without validating again
(`trusted_values`). Two fields need a codec: the grammar bitmask and the
LoRA slot loads' weights (tensors) travel as msgpack extensions (dtype,
shape, raw bytes), and a KV
connector's metadata as msgpack of its dataclass, decoded on the rank into
its connector's `metadata_cls` (`WorkerInputDecoder`). With a KV connector
every rank answers a step: its connector's report (`KVConnectorOutput`) rides
in its ModelRunnerOutput.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any, NoReturn

import msgspec
import torch

from pagedllm.core.errors import ConfigError
from pagedllm.core.sampling_params import trusted_values
from pagedllm.core.scheduler_output import KVConnectorMetadata, ModelRunnerOutput, SchedulerOutput
from pagedllm.executors.base import RankFailedError

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
    step: SchedulerOutput


WorkerInput = InitWorker | CallWorker | ExecuteModel

# ------------------------------------------------------- rank -> executor


class WorkerReply(msgspec.Struct, tag="reply", array_like=True):
    """One rank's answer to one frame: a value, a step's output, or an error."""

    rank: int
    method: str
    value: Any = None
    output: ModelRunnerOutput | None = None
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


# ------------------------------------------------------------- codecs

# msgpack extension code of a tensor: msgpack of (dtype name, shape), then its bytes.
TENSOR_EXT = 1


def encode_step(scheduler_output: SchedulerOutput) -> bytes:
    """The `ExecuteModel` frame of one step, its grammar bitmask and LoRA
    weights tensor extensions."""
    step_encoder = msgspec.msgpack.Encoder(enc_hook=partial(_encode_tensor, _step_tensors(scheduler_output)))
    try:
        return step_encoder.encode(ExecuteModel(scheduler_output))
    except TypeError as exc:
        metadata = scheduler_output.kv_connector_metadata
        if metadata is None:
            raise
        raise TypeError(
            f"KV connector metadata {type(metadata).__name__} cannot be sent to the ranks ({exc}): at "
            "tensor_parallel_size > 1 it must be plain data (block ids, hashes, numbers, strings), no tensors"
        ) from None


def _step_tensors(scheduler_output: SchedulerOutput) -> set[int]:
    """The ids of the tensors a step may carry: its bitmask and its LoRA loads' weights."""
    tensors = [tensor for load in scheduler_output.lora_loads for tensor in load.weights.values()]
    if scheduler_output.grammar_bitmask is not None:
        tensors.append(scheduler_output.grammar_bitmask)
    return {id(tensor) for tensor in tensors}


def _encode_tensor(allowed: set[int], obj: Any) -> msgspec.msgpack.Ext:
    # NOTE: only the step's own tensors: a tensor anywhere else (a connector's
    # metadata) is refused, as every rank would get a copy of it.
    if not isinstance(obj, torch.Tensor) or id(obj) not in allowed:
        raise TypeError(f"{type(obj).__name__} is not msgpack data")
    tensor = obj.detach().cpu().contiguous()
    header = encoder.encode((str(tensor.dtype).removeprefix("torch."), list(tensor.shape)))
    # As bytes (numpy has no bfloat16).
    payload = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    return msgspec.msgpack.Ext(TENSOR_EXT, len(header).to_bytes(4, "little") + header + payload)


def _decode_tensor(code: int, data: memoryview) -> torch.Tensor:
    if code != TENSOR_EXT:
        raise ValueError(f"unknown msgpack extension {code}")
    header_len = int.from_bytes(data[:4], "little")
    dtype, shape = msgspec.msgpack.decode(data[4:4 + header_len], type=tuple[str, list[int]])
    # bytearray: a writable buffer, so the tensor owns its memory.
    payload = bytearray(data[4 + header_len:])
    if not payload:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(payload, dtype=getattr(torch, dtype)).view(*shape)


def _decode_metadata(metadata_cls_of: Callable[[], type[KVConnectorMetadata] | None], type_: type, obj: Any) -> Any:
    if type_ is not KVConnectorMetadata:
        raise TypeError(f"no decoder for {type_.__name__}")
    metadata_cls = metadata_cls_of()
    if metadata_cls is None:
        raise RuntimeError("a step carries KV connector metadata, but this rank has no KV connector")
    return msgspec.convert(obj, metadata_cls)


def _no_connector() -> None:
    return None


class WorkerInputDecoder:
    """A rank's decoder of executor frames; a step's KV connector metadata
    becomes what `metadata_cls_of()` answers (the rank's connector's
    `metadata_cls`; None: it has none)."""

    def __init__(self, metadata_cls_of: Callable[[], type[KVConnectorMetadata] | None] = _no_connector) -> None:
        self._decoder = msgspec.msgpack.Decoder(
            WorkerInput, dec_hook=partial(_decode_metadata, metadata_cls_of), ext_hook=_decode_tensor
        )

    def decode(self, frame: bytes | memoryview) -> WorkerInput:
        with trusted_values():  # validated where the user's values entered
            return self._decoder.decode(frame)


encoder = msgspec.msgpack.Encoder()
reply_decoder = msgspec.msgpack.Decoder(WorkerReply)

__all__ = [
    "CallWorker",
    "ExecuteModel",
    "InitWorker",
    "WorkerInput",
    "WorkerInputDecoder",
    "WorkerReply",
    "encode_step",
    "encoder",
    "raise_reply_error",
    "reply_decoder",
]
