"""The scheduler's share of multi-LoRA serving: which adapter each slot
holds, which adapters a step may use, and what the runner must load.

Slots 1..max_loras hold adapters (slot 0 is the base model). The adapters
of running requests are pinned in their slots; an adapter no running
request uses stays in its slot until the slot is needed (LRU over the
unpinned slots), so an adapter whose requests come and go is not copied
again. A step uses at most `max_loras` distinct adapters: the running
requests' count first, and a waiting request whose adapter would be one
too many waits (it is never a reason to preempt).

Every adapter a waiting or running request names is held in the store
(`LoRAAdapterStore.request_load` / `release`), so the store never evicts
an adapter a request still needs. A slot does not hold its adapter there:
the runner keeps the slot's weights on the device, so an adapter found in
a slot needs no store copy, and a store of `max_cpu_loras == max_loras`
can still load a new adapter while unused ones sit in every slot.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import TYPE_CHECKING

from pagedllm.core.lora import LoRASlotLoad
from pagedllm.core.stats import LoRAStats

if TYPE_CHECKING:
    from pagedllm.core.lora import LoRAAdapterStore, LoRARef
    from pagedllm.core.request import Request

# LoRAAdapterStore.state of an adapter still loading.
LOADING = "loading"


class LoRASlotTable:
    def __init__(self, max_loras: int, store: LoRAAdapterStore) -> None:
        self.max_loras = max_loras
        self.store = store
        self._digest_in_slot: dict[int, str] = {}
        self._slot_of: dict[str, int] = {}
        # Slots 1..max_loras by last use, least recent first.
        self._lru: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, max_loras + 1))
        # The adapters this step uses: the running requests', then the admitted ones'.
        self._step_adapters: set[str] = set()
        self._loads: list[LoRASlotLoad] = []
        # Per adapter name, since the last stats.
        self._requests: dict[str, int] = {}
        self._prompt_tokens: dict[str, int] = {}
        self._generation_tokens: dict[str, int] = {}

    # ------------------------------------------------------------- requests

    def add_request(self, lora: LoRARef) -> None:
        """A request with adapter `lora` arrives: the store starts loading it."""
        self.store.request_load(lora)
        _count(self._requests, lora.name, 1)

    def free_request(self, request: Request) -> None:
        if request.lora is not None:
            self.store.release(request.lora.digest)

    # ------------------------------------------------------------ admission

    def begin_step(self, running: Iterable[Request]) -> None:
        """Before admitting: the running requests' adapters are this step's
        (they are in slots already), most recently used now."""
        self._step_adapters = set()
        for request in running:  # NOTE: in order, so the LRU order is the batch's
            if request.lora is not None:
                self._step_adapters.add(request.lora.digest)
                self._lru.move_to_end(self._slot_of[request.lora.digest])

    def blocker(self, lora: LoRARef) -> str | None:
        """Why a request with `lora` cannot run this step: LOADING (its
        adapter is loading, or the step has `max_loras` other adapters
        already: it waits), an error (its adapter failed to load), or None."""
        if lora.digest in self._step_adapters:
            return None
        if len(self._step_adapters) >= self.max_loras:
            return LOADING
        # In a slot already: its weights are on the device, whatever the store holds.
        return None if lora.digest in self._slot_of else self.store.state(lora.digest)

    def admit(self, lora: LoRARef) -> None:
        """The request runs this step: its adapter gets a slot (a load for
        the runner when it was not in one)."""
        digest = lora.digest
        slot = self._slot_of.get(digest)
        if slot is None:
            slot = self._free_slot()
            self._put(slot, lora)
        self._step_adapters.add(digest)
        self._lru.move_to_end(slot)

    def take_loads(self) -> list[LoRASlotLoad]:
        loads, self._loads = self._loads, []
        return loads

    def _free_slot(self) -> int:
        """An empty slot, else the least recently used one this step does not use."""
        for slot in self._lru:
            if slot not in self._digest_in_slot:
                return slot
        for slot in self._lru:
            if self._digest_in_slot[slot] not in self._step_adapters:
                return slot
        # NOTE: blocker() admits a new adapter only while fewer than max_loras are in use.
        raise RuntimeError("no LoRA slot is free although fewer than max_loras adapters are in use")

    def _put(self, slot: int, lora: LoRARef) -> None:
        old_digest = self._digest_in_slot.get(slot)
        if old_digest is not None:
            del self._slot_of[old_digest]
        self._digest_in_slot[slot] = lora.digest
        self._slot_of[lora.digest] = slot
        self._loads.append(LoRASlotLoad(slot, lora.digest, self.store.weights(lora.digest)))

    # --------------------------------------------------------------- stats

    def count_tokens(self, lora: LoRARef, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        if num_prompt_tokens:
            _count(self._prompt_tokens, lora.name, num_prompt_tokens)
        if num_generation_tokens:
            _count(self._generation_tokens, lora.name, num_generation_tokens)

    def make_stats(self, running: Iterable[Request], waiting: Iterable[Request]) -> LoRAStats:
        stats = LoRAStats(
            max_lora=self.max_loras,
            running_lora_adapters=_names(running),
            waiting_lora_adapters=_names(waiting),
            num_loaded_adapters=self.store.num_loaded(),
            load_times_s=self.store.take_load_times(),
            requests=self._requests,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
        )
        self._requests, self._prompt_tokens, self._generation_tokens = {}, {}, {}
        return stats


def _count(counts: dict[str, int], name: str, amount: int) -> None:
    counts[name] = counts.get(name, 0) + amount


def _names(requests: Iterable[Request]) -> list[str]:
    return sorted({request.lora.name for request in requests if request.lora is not None})
