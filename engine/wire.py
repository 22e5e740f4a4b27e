"""Messages between the API process and the engine-core process (msgspec).

Everything on the wire is msgpack of the typed structs below; a request's
SamplingParams (a msgspec Struct) travels as itself. It was validated where
the user's values entered (the API, `LLM`), so the core decodes it without
validating again (`trusted_values`): msgspec's typed decode checks every
field's type and refuses unknown fields. Nothing is pickled, so a crafted
request cannot run code in the engine core.

API -> core: AddRequests, AbortRequests, UtilityRequest, Shutdown.
Core -> API: Ready (handshake), StartupFailed, EngineCoreOutputs (after every
step), UtilityResult, EngineDead (the busy loop crashed).

The core's own types travel as they are: EngineCoreOutput (core/outputs.py)
and SchedulerStats (core/stats.py) are msgspec structs, never copied into
wire twins.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.core.custom_stats import MetricSpec
from pagedllm.core.generation_config import GenerationDefaults
from pagedllm.core.kv_cache.events import KVCacheEvent
from pagedllm.core.lora import LoRARef
from pagedllm.core.outputs import EngineCoreOutput
from pagedllm.core.request import Request
from pagedllm.core.sampling_params import SamplingParams, trusted_values
from pagedllm.core.stats import SchedulerStats

# ----------------------------------------------------------- API -> core


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One engine request (one sample: n > 1 fans out before this), as every
    client takes it (engine/input_processor.py builds it); the core turns it
    into its Request with `from_engine_core_request`."""

    request_id: str
    prompt_token_ids: list[int]
    # Validated by the client that built it (see the module docstring).
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    cache_salt: str | None = None
    # The API request it belongs to (its prompts and n samples share it; the
    # scheduler shares seats fairly between groups); None: its own request_id.
    group_id: str | None = None
    # The API side's compiled grammar for this request's spec (the grammar
    # backend's `serialize`), so the core loads it instead of compiling again.
    compiled_grammar: bytes | None = None
    # Its LoRA adapter as the front end registered it (None: the base model).
    lora: LoRARef | None = None


class AddRequests(msgspec.Struct, tag="add", array_like=True):
    requests: list[EngineCoreRequest]


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class UtilityRequest(msgspec.Struct, tag="utility", array_like=True):
    call_id: int
    # NOTE: the core only runs names in its own allow-list (EngineCoreProc.UTILITIES).
    name: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


CoreInput = AddRequests | AbortRequests | UtilityRequest | Shutdown

# ----------------------------------------------------------- core -> API


class Ready(msgspec.Struct, tag="ready", array_like=True):
    """What the API process needs before it can validate and tokenize."""

    pid: int
    model_path: str
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    # config.json's eos_token_id (the first one when it lists several).
    eos_token_id: int | None
    attention_backend: str
    # How the model runs: the executor's name, its ranks, their collectives.
    executor: str
    world_size: int
    communicator: str
    # The custom figures the core's components declared (core/custom_stats.py).
    custom_metrics: list[MetricSpec] = []
    # The generation config's sampling defaults and every other EOS id.
    generation: GenerationDefaults = msgspec.field(default_factory=GenerationDefaults)
    # With LoRA on: the checkpoint modules that hold adapter slots, with their
    # full (out, in); adapters are checked against them when registered.
    lora_modules: dict[str, tuple[int, int]] | None = None


class StartupFailed(msgspec.Struct, tag="startup_failed", array_like=True):
    error_type: str
    message: str


class EngineCoreOutputs(msgspec.Struct, tag="outputs", array_like=True):
    """One engine step's outputs (empty when only stats changed, e.g. after
    an abort while idle, or the idle heartbeat)."""

    outputs: list[EngineCoreOutput]
    scheduler_stats: SchedulerStats | None
    # Tokens the step computed (0: no step ran).
    num_scheduled_tokens: int
    timestamp: float
    # What the prefix cache gained and lost (cache.enable_kv_events), in order.
    kv_events: list[KVCacheEvent] = []


class UtilityResult(msgspec.Struct, tag="utility_result", array_like=True):
    call_id: int
    result: Any = None
    # "ErrorType: message" when the call raised.
    error: str | None = None


class EngineDead(msgspec.Struct, tag="dead", array_like=True):
    """Sent once when the busy loop crashes, just before the process exits."""

    error: str
    # The executor rank whose failure crashed it (RankFailedError), if one did.
    failed_rank: int | None = None


CoreOutput = Ready | StartupFailed | EngineCoreOutputs | UtilityResult | EngineDead


# ------------------------------------------------------------- codecs


class CoreInputEncoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: CoreInput) -> bytes:
        return self._encoder.encode(message)


class CoreInputDecoder:
    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(CoreInput)

    def decode(self, data: bytes | memoryview) -> CoreInput:
        with trusted_values():  # validated by the client; typed decode only
            return self._decoder.decode(data)


class CoreOutputEncoder:
    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()

    def encode(self, message: CoreOutput) -> bytes:
        return self._encoder.encode(message)


class CoreOutputDecoder:
    def __init__(self) -> None:
        self._decoder = msgspec.msgpack.Decoder(CoreOutput)

    def decode(self, data: bytes) -> CoreOutput:
        return self._decoder.decode(data)


# ------------------------------------------------------------- the core


def from_engine_core_request(wire: EngineCoreRequest) -> Request:
    """The scheduler's Request for a client's request."""
    request = Request(
        wire.request_id,
        wire.prompt_token_ids,
        wire.sampling_params,
        eos_token_id=wire.eos_token_id,
        arrival_time=wire.arrival_time,
        priority=wire.priority,
        cache_salt=wire.cache_salt,
        group_id=wire.group_id,
        lora=wire.lora,
    )
    request.compiled_grammar = wire.compiled_grammar
    return request

