"""The engine core's loaded LoRA adapters (core/lora.py's LoRAAdapterStore).

An LRU of at most `lora.max_cpu_loras` adapters (default `max_loras`),
keyed by content digest. Adapters load on a background thread, so a request
whose adapter is loading waits without stalling the step. The digest of
what was loaded must equal the one the adapter was registered with (the
front end computed it): if the files changed in between, every request
naming the old digest fails with an error that says so, and nothing of the
new files is served under the old identity.

An adapter that a waiting or running request holds (`request_load` ..
`release`) is never evicted; when every place is held, a new load waits
(its requests stay waiting) until a holder lets go. Adapters sitting in the
device's slots are not held (core/lora_slots.py): the slots keep their own
copy.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedllm.core.lora_slots import LOADING

if TYPE_CHECKING:
    import torch

    from pagedllm.core.config import LoRAConfig
    from pagedllm.core.lora import LoRARef

# ref -> (the loaded adapter's digest, its weights as LoRASlotLoad carries them).
AdapterLoader = Callable[["LoRARef"], tuple[str, "dict[str, torch.Tensor]"]]


@dataclass(slots=True)
class _Entry:
    ref: LoRARef
    holders: int = 1
    # "queued" (no room yet), LOADING, "ready" or "failed".
    phase: str = "queued"
    weights: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class LoRAStore:
    """The engine core's adapters; thread-safe (loads finish on a pool thread)."""

    def __init__(
        self,
        config: LoRAConfig,
        loader: AdapterLoader | None = None,
        max_load_threads: int = 1,
        adaptable_modules: Mapping[str, tuple[int, int]] | None = None,
    ) -> None:
        """`adaptable_modules`: the model's modules that hold adapter slots,
        with their (out, in) (the worker's `lora_supported_modules`): an
        adapter for any other module fails its requests here, never a step."""
        self.capacity = config.max_cpu_loras or config.max_loras
        self._loader = loader if loader is not None else _peft_loader(config, adaptable_modules)
        self._lock = threading.Lock()
        # Least recently used first.
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_load_threads, thread_name_prefix="lora-load")
        self._futures: set[Future[None]] = set()
        self._load_times: list[float] = []

    # ------------------------------------------------------ the protocol

    def request_load(self, ref: LoRARef) -> None:
        with self._lock:
            entry = self._entries.get(ref.digest)
            if entry is None:
                self._entries[ref.digest] = _Entry(ref)
            else:
                entry.holders += 1
                self._entries.move_to_end(ref.digest)
            self._start_queued()

    def release(self, digest: str) -> None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return
            entry.holders -= 1
            if entry.holders <= 0 and entry.phase in ("queued", "failed"):
                del self._entries[digest]  # a failed load is tried again next time
            self._start_queued()

    def state(self, digest: str) -> str | None:
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return f"LoRA adapter with digest {digest[:16]} is not held by the engine"
            if entry.phase == "ready":
                return None
            if entry.phase == "failed":
                return entry.error
            return LOADING

    def weights(self, digest: str) -> dict[str, Any]:
        with self._lock:
            entry = self._entries[digest]
            self._entries.move_to_end(digest)
            return entry.weights

    def num_loaded(self) -> int:
        with self._lock:
            return sum(entry.phase == "ready" for entry in self._entries.values())

    def take_load_times(self) -> list[float]:
        with self._lock:
            times, self._load_times = self._load_times, []
            return times

    def wait_for_loads(self, timeout_s: float) -> None:
        with self._lock:
            pending = list(self._futures)
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # --------------------------------------------------------- internals

    def _start_queued(self) -> None:
        """Start every queued load there is room for (NOTE: under the lock)."""
        for digest, entry in list(self._entries.items()):
            if entry.phase != "queued":
                continue
            if not self._make_room():
                return
            entry.phase = LOADING
            future = self._pool.submit(self._load, digest, entry.ref)
            self._futures.add(future)
            future.add_done_callback(self._futures.discard)

    def _make_room(self) -> bool:
        """Room for one more loaded adapter: evict the least recently used
        one nobody holds if need be; False when every place is held."""
        in_memory = [d for d, e in self._entries.items() if e.phase in (LOADING, "ready")]
        if len(in_memory) < self.capacity:
            return True
        for digest in in_memory:
            if self._entries[digest].holders <= 0:
                del self._entries[digest]
                return True
        return False

    def _load(self, digest: str, ref: LoRARef) -> None:
        start = time.perf_counter()
        try:
            loaded_digest, weights = self._loader(ref)
            error = None if loaded_digest == digest else (
                f"LoRA adapter {ref.name!r} ({ref.path}): its files changed since it was registered "
                f"(digest {digest[:16]}, now {loaded_digest[:16]}); load the adapter again"
            )
        except Exception as exc:  # any failure fails its requests, never the engine
            weights, error = {}, f"LoRA adapter {ref.name!r} ({ref.path}) failed to load: {exc}"
        with self._lock:
            entry = self._entries.get(digest)
            if entry is None:
                return
            if error is None:
                entry.phase, entry.weights = "ready", weights
                self._load_times.append(time.perf_counter() - start)
            else:
                entry.phase, entry.error = "failed", error
                if entry.holders <= 0:
                    del self._entries[digest]
            self._start_queued()


def _peft_loader(config: LoRAConfig, adaptable_modules: Mapping[str, tuple[int, int]] | None) -> AdapterLoader:
    """Load with lora/adapter.py's checks (rank, size, and the modules the
    model holds slots for: the front end checked only the checkpoint's)."""

    def load(ref: LoRARef) -> tuple[str, dict[str, torch.Tensor]]:
        from pagedllm.lora.adapter import load_lora_adapter

        adapter = load_lora_adapter(
            ref.path, name=ref.name, max_rank=config.max_lora_rank, max_bytes=config.max_lora_bytes,
            base_modules=adaptable_modules,
        )
        return adapter.ref.digest, adapter.weights

    return load
