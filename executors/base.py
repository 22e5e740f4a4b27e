"""The executor interface: what the engine builder and the engine core ask of
whatever launches the workers (vLLM's `Executor`).

Built as ``ExecutorCls(engine_config)``, an executor starts one
:class:`pagedllm.worker.worker.Worker` per rank and loads the model on each.
The builder then asks it for the number of KV blocks every rank can hold,
hands the chosen number back to ``initialize_cache``, and gives the executor
to the engine core as its ``model_executor``: ``execute_model`` runs one step
on every rank and returns rank 0's result. With a KV connector each rank holds
its worker side and reports with its step output (the builder builds the
scheduler's side, the same for every executor); an executor of several ranks
merges the ranks' reports.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import msgspec

from pagedllm.core.kv_cache.kv_cache_interface import KVCacheConfig

if TYPE_CHECKING:
    import torch

    from pagedllm.attention_backends.base import AttentionBackend
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
    from pagedllm.platforms.interface import Platform
    from pagedllm.worker.model_facts import ModelFacts


class AttentionSelection(Protocol):
    """The attention backend chosen for every rank, and why others were not
    (`attention_backends.selector.BackendSelection` is one)."""

    @property
    def name(self) -> str: ...

    @property
    def backend_cls(self) -> type[AttentionBackend]: ...

    @property
    def rejected(self) -> dict[str, list[str]]: ...


class RankFailedError(RuntimeError):
    """A rank died or a call on it raised: the executor (and the engine
    using it) cannot run another step. The message names the rank and the
    cause; in-flight requests fail with it."""

    def __init__(self, rank: int, cause: str) -> None:
        super().__init__(f"executor rank {rank} failed: {cause}")
        self.rank = rank
        self.cause = cause


class Executor(ABC):
    """Starts the workers, relays steps and utility calls to them, stops them.

    A subclass implements ``_init_executor`` (start the workers, load the
    model), ``_run_workers`` (call one Worker method on every rank),
    ``execute_model`` and the facts below; the rest is built on those.
    """

    # NOTE: the Worker methods `collective_rpc` may call, and no others: a
    # utility call names a method, never code to run.
    RPC_METHODS: ClassVar[frozenset[str]] = frozenset(
        {"load_model", "determine_num_kv_blocks", "initialize_cache", "execute_model", "check_health", "shutdown",
         "memory_usage", "collective_stats", "kv_connector_shard", "kv_cache_config", "model_custom_metrics",
         "lora_supported_modules"}
    )

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # Async scheduling: the thread that runs the steps, one at a time.
        self._step_thread: ThreadPoolExecutor | None = None
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start one Worker per rank and load the model on each."""

    @abstractmethod
    def _run_workers(self, method: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[Any]:
        """``method(*args, **kwargs)`` on every rank's Worker; the results in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; rank 0's result (core's `ModelExecutor`)."""

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start one step and return at once (async scheduling): `execute_model`
        on the executor's step thread, so the steps run one at a time, in order,
        while the engine schedules the next one and processes the last one's
        outputs (torch and socket waits release the GIL)."""
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(
                1, thread_name_prefix="pagedllm-step", initializer=self._init_step_thread
            )
        return self._step_thread.submit(self.execute_model, scheduler_output)

    def _init_step_thread(self) -> None:  # noqa: B027 - a hook: most executors keep no per-thread state
        """Per-thread state the steps need (a CUDA rank's current device)."""

    def _join_step_thread(self) -> None:
        """Let a step in flight finish before the ranks stop (each
        `shutdown` calls this first)."""
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None

    # ---- facts the builder, READY and `pagedllm env` report (rank 0's) ----

    @property
    @abstractmethod
    def model_facts(self) -> ModelFacts:
        """What the model's config says (path, HF config, dtype, heads)."""

    @property
    @abstractmethod
    def attn_selection(self) -> AttentionSelection:
        """The attention backend every rank runs, and the ones rejected."""

    @property
    @abstractmethod
    def platform(self) -> Platform: ...

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Rank 0's device."""

    # ---- built on the above -------------------------------------------------

    def collective_rpc(
        self, method: str, args: Sequence[Any] = (), kwargs: Mapping[str, Any] | None = None
    ) -> list[Any]:
        """Call the Worker method `method` on every rank (a utility call:
        profile, cache set-up, health); the results in rank order."""
        if method not in self.RPC_METHODS:
            raise ValueError(f"collective_rpc: {method!r} is not a Worker method; allowed: "
                             + ", ".join(sorted(self.RPC_METHODS)))
        if self._step_thread is not None:  # after the steps in flight, never beside them
            return self._step_thread.submit(self._run_workers, method, args, kwargs or {}).result()
        return self._run_workers(method, args, kwargs or {})

    def determine_num_kv_blocks(self) -> int:
        """KV blocks every rank can hold: the minimum over ranks."""
        num_blocks: list[int] = self.collective_rpc("determine_num_kv_blocks")
        return min(num_blocks)

    def kv_cache_config(self) -> KVCacheConfig:
        """The model's KV cache groups (every rank groups its layers alike: rank 0's)."""
        # NOTE: a rank in another process answers with the struct's fields.
        return msgspec.convert(self.collective_rpc("kv_cache_config")[0], KVCacheConfig)

    def lora_supported_modules(self) -> dict[str, tuple[int, int]] | None:
        """The checkpoint modules that hold adapter slots, with their full
        (out, in) (None: LoRA is off); every rank holds the same: rank 0's."""
        modules = self.collective_rpc("lora_supported_modules")[0]
        # NOTE: a rank in another process answers with lists for the tuples.
        return None if modules is None else {name: (int(out), int(inp)) for name, (out, inp) in modules.items()}

    def initialize_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate `num_blocks` KV blocks on every rank and build what reads them."""
        self.collective_rpc("initialize_cache", (num_blocks, max_model_len))

    def check_health(self) -> None:
        """Raise if a rank cannot run a step."""
        self.collective_rpc("check_health")

    def shutdown(self) -> None:
        """Stop the workers (and release what they hold); safe to call twice."""
        self._join_step_thread()
        self.collective_rpc("shutdown")


__all__ = ["AttentionSelection", "Executor", "RankFailedError"]
