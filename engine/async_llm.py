"""AsyncLLM: the asyncio front end of the engine (vLLM's v1 AsyncLLM).

The engine core runs its busy loop in another process (or, for tests, a
thread); this side tokenizes, validates, fans n > 1 out and back in
(OutputProcessor), detokenizes, and feeds the stat logger. One background
task reads the core's outputs and routes RequestOutputs to per-request
queues; `generate()` drains its queue.

    llm = AsyncLLM(config)            # blocks until the core is ready
    async for output in llm.generate("Hello", SamplingParams(max_tokens=8), "req-0"):
        ...
    llm.shutdown()

or `llm = await AsyncLLM.create(config)`. The output task starts on the first
`generate()` / utility call (or `await llm.start()`), in the running loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from collections import Counter
from collections.abc import AsyncGenerator
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import (
    EngineDeadError,
    EngineOverloadedError,
    EngineUnresponsiveError,
    InvalidRequestError,
    ServerShuttingDownError,
)
from pagedllm.core.stats import IterationStats
from pagedllm.engine.core_client import DEFAULT_STARTUP_TIMEOUT_S, AsyncMPClient
from pagedllm.engine.core_start import start_async_engine_core
from pagedllm.engine.dp_client import DPAsyncMPClient, ReplicaFailure
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.kv_event_log import KVEventLog
from pagedllm.engine.metrics import StatLoggerManager, stat_logger_names
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.outputs import CompletionOutput, RequestOutput, RequestOutputKind
from pagedllm.lora.registry import LoRARegistry
from pagedllm.model_registry.generation_config import log_generation_defaults
from pagedllm.model_registry.model_source import model_display_name, resolve_hub_models, resolve_model_path
from pagedllm.model_registry.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.lora import LoRARef
    from pagedllm.core.sampling_params import SamplingParams
    from pagedllm.core.stats import SchedulerStats
    from pagedllm.engine.wire import EngineCoreOutputs
    from pagedllm.lora.request import LoRARequest

logger = logging.getLogger(__name__)

def served_name_of(model: str | None) -> str:
    """/v1/models' name for a model: the name of the folder it resolves to
    (the default and `tiny` serve as `pagedllm-tiny`); a GGUF file's stem."""
    return model_display_name(resolve_model_path(model))


# Outputs processed between yields to the event loop (vLLM's
# VLLM_V1_OUTPUT_PROC_CHUNK_SIZE): a big batch must not stall HTTP handling.
OUTPUT_PROC_CHUNK_SIZE = 128


class _RequestStream:
    """Where the output task puts one request's outputs (or its error)."""

    def __init__(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], n: int, group_id: str
    ) -> None:
        self.request_id = request_id
        # The API request it belongs to (its admission's group, else itself).
        self.group_id = group_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.n = n
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        # Its adapter, which each of its RequestOutputs names.
        self.lora_request: LoRARequest | None = None

    def aborted_output(self) -> RequestOutput:
        completions = [
            CompletionOutput(index, "", [], None, None, finish_reason="abort") for index in range(self.n)
        ]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, None, completions, True)


_admission_ids = itertools.count()


class RequestReservation:
    """Sequences reserved for one HTTP request by `AsyncLLM.admit()` before any
    of its prompts reaches the engine, so a request is admitted whole or not
    at all; each `generate(..., admission=...)` takes its n from here. Its
    prompts' sequences form one group: they share one request's part of the
    pending limit and of the scheduler's seats.

    NOTE: a reservation nobody takes (a prompt never started) is released
    when the request's handler lets go of this object (AsyncLLM holds it
    weakly): there is no release call to forget."""

    __slots__ = ("__weakref__", "group_id", "num_reserved")

    def __init__(self, num_sequences: int) -> None:
        self.num_reserved = num_sequences
        self.group_id = f"admission-{next(_admission_ids)}"

    def take(self, num_sequences: int) -> bool:
        if num_sequences > self.num_reserved:
            return False
        self.num_reserved -= num_sequences
        return True


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        *,
        in_process: bool = False,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        engine_core: AsyncMPClient | DPAsyncMPClient | None = None,
    ) -> None:
        """`engine_core`: a core `start_async_engine_core(config)` started
        (the server starts it before importing its HTTP stack); this
        AsyncLLM owns it from here on. None: start one now."""
        try:
            # Hub ids download before the core starts (a no-op on a config
            # `serve` resolved already: its names are folders by then).
            self.config = config = resolve_hub_models(config)
            stat_logger_names(config)  # an unknown name fails before the core starts
        except BaseException:
            if engine_core is not None:
                engine_core.shutdown()
            raise
        self.engine_core: AsyncMPClient | DPAsyncMPClient = (
            engine_core if engine_core is not None else start_async_engine_core(config, in_process=in_process)
        )
        try:
            self._start_front_end(config, startup_timeout_s)
        except BaseException:
            self.engine_core.shutdown()  # NOTE: a front end that cannot start must not leave the core behind
            raise
        self.kv_event_log = self._connect_routing(config)
        ready = self.ready
        logger.info(
            "engine ready: executor %s, %d rank(s), collectives %s, attention backend %s, %d KV blocks",
            ready.executor, ready.world_size, ready.communicator, ready.attention_backend, ready.num_kv_blocks,
        )
        self._streams: dict[str, _RequestStream] = {}
        self._admissions: weakref.WeakSet[RequestReservation] = weakref.WeakSet()
        # Set by end_all_requests() (shutdown): new requests are refused with it.
        self._refusal: str | None = None
        # The health ping in flight, shared by concurrent checks, and when it was sent.
        self._health_ping: asyncio.Future[Any] | None = None
        self._health_ping_sent_at = 0.0
        self._output_task: asyncio.Task[None] | None = None
        self._output_loop: asyncio.AbstractEventLoop | None = None

    def _start_front_end(self, config: EngineConfig, startup_timeout_s: float) -> None:
        """Tokenizer, input/output processing and stat loggers, once the core is ready."""
        # The tokenizer loads while the core loads the model.
        self.tokenizer = load_tokenizer(
            config.model.tokenizer or resolve_model_path(config.model.model), config.model.trust_remote_code
        )
        self.ready = ready = self.engine_core.wait_for_ready(startup_timeout_s)
        self.input_processor = InputProcessor(
            self.tokenizer, ready, config.structured_output, config.model.logits_processors,
            enable_lora=config.lora.enable_lora,
        )
        # Adapters are registered (loaded, checked, hashed) on first use, off the event loop.
        self.lora_registry = (
            LoRARegistry(ready.model_path, config.lora, ready.lora_modules) if config.lora.enable_lora else None
        )
        log_generation_defaults(config.model, self.input_processor.default_sampling_params)
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.eos_token_id = self.input_processor.eos_token_id
        served_names = config.server.served_model_name
        # The first served name is what responses and metrics say (the others are accepted in requests).
        self.model_name = served_names[0] if served_names else served_name_of(config.model.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.stat_logger = StatLoggerManager(
            model_name=self.model_name,
            config=config,
            num_kv_blocks=ready.num_kv_blocks,
            max_model_len=ready.max_model_len,
            world_size=ready.world_size,
            custom_metrics=ready.custom_metrics,
        )

    @classmethod
    async def create(cls, config: EngineConfig, **kwargs: Any) -> AsyncLLM:
        """Construct (blocking this loop until the core is ready: the server
        is not serving yet) and start the output task.

        NOTE: not in an executor thread: the core dies with the thread that
        spawned it (PR_SET_PDEATHSIG)."""
        llm = cls(config, **kwargs)
        await llm.start()
        return llm

    @property
    def engine_pid(self) -> int | None:
        """The engine-core process id (None when in_process)."""
        return self.engine_core.engine_pid

    @property
    def engine_pids(self) -> list[int | None]:
        """Every data-parallel replica's engine-core process id, by index."""
        if isinstance(self.engine_core, DPAsyncMPClient):
            return self.engine_core.engine_pids
        return [self.engine_core.engine_pid]

    # -------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the output task in the running loop (again in a new loop)."""
        loop = asyncio.get_running_loop()
        if self._output_loop is loop and self._output_task is not None and not self._output_task.done():
            return
        self._output_loop = loop
        self._output_task = loop.create_task(self._run_output_handler(), name="AsyncLLM.output_handler")

    def shutdown(self) -> None:
        """Stop the output task and the engine core (no orphan); idempotent."""
        task = self._output_task
        if task is not None and not task.done() and not task.get_loop().is_closed():
            task.cancel()
        self._fail_all(EngineDeadError("the engine was shut down"))
        self.engine_core.shutdown()
        self.stat_logger.shutdown()

    @property
    def errored(self) -> bool:
        return self.engine_core.errored

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    @property
    def num_pending_sequences(self) -> int:
        """The engine sequences (prompts x n) of unfinished requests plus
        those admitted, not yet added."""
        return sum(self._pending_per_group().values())

    @property
    def num_counted_pending_sequences(self) -> int:
        """What `server.max_pending_requests` limits: the pending sequences,
        each request's counted up to its share (`server.max_pending_share`)."""
        share = self._pending_share
        return sum(min(count, share) for count in self._pending_per_group().values())

    @property
    def _pending_share(self) -> int:
        server = self.config.server
        return max(1, int(server.max_pending_requests * server.max_pending_share))

    def _pending_per_group(self) -> Counter[str]:
        per_group: Counter[str] = Counter()
        for admission in self._admissions:
            per_group[admission.group_id] += admission.num_reserved
        for stream in self._streams.values():
            per_group[stream.group_id] += stream.n
        return per_group

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine core died, EngineUnresponsiveError
        if it showed no life within `server.health_timeout_s` (stopped, wedged).

        Healthy at once when the core sent anything (a step's outputs, a ping's
        answer) within the timeout, so a busy core costs /health no wait;
        otherwise wait for a ping. One ping is in flight at a time, shared by
        concurrent checks, and each check sends a new one if none is; once the
        one in flight is older than the timeout, checks fail at once until the
        core answers it. A core that stops is reported within about one timeout.
        """
        self.engine_core.check_alive()
        await self.start()
        timeout_s = self.config.server.health_timeout_s
        ping = self._health_ping_in_flight()
        now = time.monotonic()
        remaining_s = self._health_ping_sent_at + timeout_s - now
        if remaining_s <= 0:
            raise EngineUnresponsiveError(timeout_s)
        if now - self.engine_core.last_heard_at < timeout_s:
            return
        try:
            # shield: a check that gives up must not cancel the ping others wait for.
            await asyncio.wait_for(asyncio.shield(ping), remaining_s)
        except TimeoutError:
            raise EngineUnresponsiveError(timeout_s) from None

    def _health_ping_in_flight(self) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        ping = self._health_ping
        if ping is None or ping.done() or ping.get_loop() is not loop:
            ping = self._health_ping = loop.create_task(self.engine_core.call_utility_async("ping"))
            # Nobody may await it (a fresh core answers checks): its error is not news.
            ping.add_done_callback(lambda task: task.cancelled() or task.exception())
            self._health_ping_sent_at = time.monotonic()
        return ping

    # --------------------------------------------------------------- requests

    def admit(self, num_prompts: int, n: int) -> RequestReservation:
        """Admit one request of `num_prompts` prompts x `n` samples as a whole,
        before any of its prompts reaches the engine; pass the result to each
        of its `generate()` calls. InvalidRequestError (400) if it alone
        exceeds `server.max_pending_requests`, EngineOverloadedError (503)
        if it does not fit beside the sequences already pending (each
        request counted up to `server.max_pending_share` of the limit)."""
        self._check_accepting()
        num_sequences = num_prompts * n
        self._check_pending_limit(num_sequences, num_prompts, n)
        admission = RequestReservation(num_sequences)
        self._admissions.add(admission)
        return admission

    def _check_pending_limit(self, num_sequences: int, num_prompts: int, n: int) -> None:
        limit = self.config.server.max_pending_requests
        if num_sequences > limit:
            field, value = ("n", n) if n > 1 else ("prompt", num_prompts)
            raise InvalidRequestError(
                field, value, f"{num_prompts} prompt(s) x n={n} = {num_sequences} sequences exceed the limit "
                f"on pending sequences (server.max_pending_requests = {limit})",
            )
        # NOTE: a request counts for at most its share, so one request at the
        # limit leaves room for others; its other sequences queue in the
        # scheduler, which shares the seats between requests.
        num_counted = min(num_sequences, self._pending_share)
        num_pending = self.num_counted_pending_sequences
        if num_pending + num_counted > limit:
            raise EngineOverloadedError(num_pending, limit, num_counted)

    def _check_accepting(self) -> None:
        if self._refusal is not None:
            raise ServerShuttingDownError(self._refusal)
        self.engine_core.check_alive()

    async def generate(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        *,
        prompt_text: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        output_kind: RequestOutputKind = RequestOutputKind.DELTA,
        admission: RequestReservation | None = None,
        validated: bool = False,
        compiled_grammar: bytes | None = None,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yield the request's RequestOutputs as the core produces them.

        Errors (InvalidRequestError, EngineOverloadedError, EngineDeadError)
        raise at the first iteration. If the consumer stops early (break,
        client disconnect: GeneratorExit / CancelledError) the request is
        aborted in the core at once. With `admission` (from `admit()`) its
        sequences were counted already; without, they are counted here.
        `validated`: the caller ran `input_processor.validate` on these very params
        and prompt (the HTTP handlers do, in the worker pool), so it is not
        run again here, on the event loop. NOTE: the engine core does not
        validate the params again (its decode checks their types only).
        `compiled_grammar`: what the validator lane returned for its spec.
        `lora_request`: the adapter to run with (registered on first use, in a
        worker thread; LoRAAdapterError for an adapter not valid for this model).
        """
        self._check_accepting()
        await self.start()
        lora = None if lora_request is None else await asyncio.to_thread(self.register_lora, lora_request)
        stream = self._add_request(
            prompt, sampling_params, request_id, prompt_text, priority, cache_salt, output_kind, admission, validated,
            compiled_grammar, lora,
        )
        stream.lora_request = lora_request
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    finished = True  # the core is gone; nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._abort_request(request_id)

    def _add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams,
        request_id: str,
        prompt_text: str | None,
        priority: int,
        cache_salt: str | None,
        output_kind: RequestOutputKind,
        admission: RequestReservation | None = None,
        validated: bool = False,
        compiled_grammar: bytes | None = None,
        lora: LoRARef | None = None,
    ) -> _RequestStream:
        n = sampling_params.n
        if admission is None or not admission.take(n):
            self._check_pending_limit(n, 1, n)
        if request_id in self._streams:
            raise InvalidRequestError("request_id", request_id, "a request with this id is still running")
        request = self.input_processor.process(
            request_id, prompt, sampling_params, prompt_text=prompt_text, priority=priority,
            cache_salt=cache_salt, validated=validated, compiled_grammar=compiled_grammar, lora=lora,
        )
        self.output_processor.add_request(request, output_kind)
        group_id = admission.group_id if admission is not None else request_id
        stream = _RequestStream(request_id, request.prompt, request.prompt_token_ids, sampling_params.n, group_id)
        self._streams[request_id] = stream
        try:
            self.engine_core.add_requests(request.engine_requests(group_id))
        except BaseException:
            self._streams.pop(request_id, None)
            self.output_processor.abort_requests([request_id])
            raise
        return stream

    def register_lora(self, lora_request: LoRARequest) -> LoRARef:
        """The LoRARef of `lora_request`'s adapter (blocking: it may read and
        hash the weights; the server calls it off the event loop)."""
        if self.lora_registry is None:
            raise InvalidRequestError(
                "lora_request", lora_request.lora_name,
                "this engine serves no LoRA adapters (start it with --enable-lora)",
            )
        return self.lora_registry.ref_for(lora_request)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its generate() ends with a finish_reason "abort" output."""
        stream = self._streams.get(request_id)
        self._abort_request(request_id)
        if stream is not None:
            stream.queue.put_nowait(stream.aborted_output())

    def _abort_request(self, request_id: str) -> None:
        # NOTE: synchronous on purpose: it runs in generate()'s finally, where
        # a cancelled task must not await.
        self._streams.pop(request_id, None)
        self._abort_in_core(self._forget_aborted([request_id]))

    def _forget_aborted(self, request_ids: list[str]) -> list[str]:
        """Drop requests from the output processor, counting each unfinished
        sample once as finished by "abort"; returns their engine request ids."""
        iteration_stats = IterationStats()
        engine_request_ids = self.output_processor.abort_requests(request_ids, iteration_stats)
        if iteration_stats.finished_requests:
            self.stat_logger.record(None, iteration_stats)
        return engine_request_ids

    def _abort_in_core(self, engine_request_ids: list[str]) -> None:
        with contextlib.suppress(EngineDeadError):  # dead: nothing left to free
            self.engine_core.abort_requests(engine_request_ids)

    def end_all_requests(self, reason: str = "the server is shutting down") -> int:
        """Shutdown's last step: end every unfinished request with
        ServerShuttingDownError (its client gets a 503, or an error chunk and
        [DONE]), abort it in the core, and refuse new requests from now on.
        Returns how many requests it ended."""
        self._refusal = reason
        streams = list(self._streams)
        self._fail_all(ServerShuttingDownError(reason))
        return len(streams)

    # -------------------------------------------------------------- utilities

    async def get_stats(self) -> SchedulerStats | None:
        """The core's SchedulerStats now: the core sends them the way it does
        after a step (so the stat logger counts them too), then answers.
        None only if the core never sent any. This side's figures are
        `num_unfinished_requests` and `num_pending_sequences`."""
        await self.start()
        await self.engine_core.call_utility_async("flush_stats")
        return self.engine_core.scheduler_stats

    async def memory_usage(self) -> list[dict[str, int]]:
        """Each rank's `Worker.memory_usage()` (pid, weights, KV cache and the
        KV cache's resident host bytes), by rank; the first data-parallel
        replica's."""
        await self.start()
        return list(await self.engine_core.call_utility_async("memory_usage"))

    async def reset_prefix_cache(self) -> bool:
        await self.start()
        return bool(await self.engine_core.call_utility_async("reset_prefix_cache"))

    # ----------------------------------------------------------- output task

    async def _run_output_handler(self) -> None:
        try:
            while True:
                message = await self.engine_core.get_output_async()
                if isinstance(message, ReplicaFailure):
                    self._fail_requests(message.request_ids, message.error)
                elif message is not None:
                    await self._process_engine_outputs(message)
                self.stat_logger.maybe_log()
        except EngineDeadError as exc:
            logger.error("%s", exc)
            if self.stat_logger.prometheus is not None:
                self.stat_logger.prometheus.record_engine_dead(exc.failed_rank)
            self._fail_all(exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            # A bug on this side: no request could finish any more.
            logger.exception("AsyncLLM output handler failed")
            dead = EngineDeadError(f"the engine's output handler failed: {type(exc).__name__}: {exc}")
            self.engine_core.dead_error = dead
            self._fail_all(dead)

    def _connect_routing(self, config: EngineConfig) -> KVEventLog | None:
        """The log of what the prefix caches hold, for a router in front of
        this server (GET /v1/kv_events; None unless the engines report it),
        and the data-parallel router's metrics and log."""
        log = None
        if config.cache.enable_kv_events:
            log = KVEventLog(config.parallel.data_parallel_size, block_size=config.cache.block_size,
                             hash_algo=config.cache.prefix_caching_hash_algo)
        if isinstance(self.engine_core, DPAsyncMPClient):
            if self.stat_logger.prometheus is not None:
                self.stat_logger.prometheus.add_router_metrics(len(self.engine_core.clients))
                self.engine_core.router.observer = self.stat_logger.prometheus
            self.engine_core.router.event_log = log
        return log

    async def _process_engine_outputs(self, message: EngineCoreOutputs) -> None:
        if self.kv_event_log is not None and isinstance(self.engine_core, AsyncMPClient):
            self.kv_event_log.apply(0, message.kv_events)  # (a data-parallel router applies each replica's)
        outputs = message.outputs
        now = time.time()
        iteration_stats = IterationStats(iteration_timestamp=now) if outputs else None
        for start in range(0, len(outputs), OUTPUT_PROC_CHUNK_SIZE):
            if start:
                await asyncio.sleep(0)
            processed = self.output_processor.process_outputs(
                outputs[start : start + OUTPUT_PROC_CHUNK_SIZE], now, iteration_stats
            )
            # Finished here by a stop string: the core still runs them.
            self.engine_core.abort_requests(processed.reqs_to_abort)
            for request_output in processed.request_outputs:
                stream = self._streams.get(request_output.request_id)
                if stream is None:
                    continue
                request_output.lora_request = stream.lora_request
                stream.queue.put_nowait(request_output)
                if request_output.finished:
                    del self._streams[request_output.request_id]
        self.stat_logger.record(message.scheduler_stats, iteration_stats, message.num_scheduled_tokens)

    def _fail_requests(self, engine_request_ids: list[str], error: BaseException) -> None:
        """A data-parallel replica died: fail the requests it held (every
        sample of each), the others keep going."""
        owners = {self.output_processor.owner_of(engine_request_id) for engine_request_id in engine_request_ids}
        request_ids = sorted(owner for owner in owners if owner is not None)
        logger.error("%s: failing %d request(s) it held", error, len(request_ids))
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                stream.queue.put_nowait(error)
        self._forget_aborted(request_ids)

    def replica_health(self) -> list[dict[str, Any]] | None:
        """Each data-parallel replica's state (None with one engine)."""
        if isinstance(self.engine_core, DPAsyncMPClient):
            return self.engine_core.replica_health()
        return None

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            stream.queue.put_nowait(error)
        engine_request_ids = self._forget_aborted(list(streams))
        if not self.engine_core.errored:
            self._abort_in_core(engine_request_ids)
