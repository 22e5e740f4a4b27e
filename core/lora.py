"""What the core knows of LoRA adapters: their identity, and the slots
they occupy while their requests run.

An adapter's identity is its content: `LoRARef.digest` is a SHA-256 over
its config and every tensor (lora/identity.py computes it when the adapter
is registered, and again over the bytes the engine core loads: the two
must agree, or the request fails). The digest, never the name or the path,
enters every block hash of the adapter's requests (core/kv_cache/hashing.py),
the KV events, connector block names and the router's prefix matching. So
different weights under one name never share KV, a base request never hits
an adapter's blocks, and two names for the same files may share.

The engine core holds the loaded adapters (`LoRAAdapterStore`, implemented
by lora/, wired in by the builder); the scheduler admits at most
`max_loras` distinct adapters per step and gives each a slot 1..max_loras
(slot 0 is the base model: no adapter). A slot whose adapter changes rides
on the SchedulerOutput as a `LoRASlotLoad` with the adapter's tensors, and
every rank copies its shard of them into its layers' slot buffers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import msgspec

if TYPE_CHECKING:
    from torch import Tensor
else:
    Tensor = Any  # the core does not import torch (see core/scheduler_output.py)

# The slot of rows without an adapter; adapters take slots 1..max_loras.
NO_LORA_SLOT = 0


class LoRARef(msgspec.Struct, frozen=True, array_like=True):
    """An adapter as a request names it."""

    # The name the client used ("model": NAME), for outputs and metrics only.
    name: str
    # SHA-256 (hex) of the adapter's config and weights: its identity.
    digest: str
    # The folder it was registered from (the engine core loads it from there
    # and checks the digest again).
    path: str


class LoRASlotLoad(msgspec.Struct, array_like=True):
    """Slot `slot` holds adapter `digest` from this step on: `weights` maps
    "<module>.lora_A" ([rank, in]) and "<module>.lora_B" ([out, rank], the
    adapter's scaling already applied) for each module it adapts, the
    module named as in the base checkpoint (`model.layers.0.self_attn.q_proj`)."""

    slot: int
    digest: str
    weights: dict[str, Tensor]


class LoRAAdapterStore(Protocol):
    """The engine core's loaded adapters (lora/store.py implements it).
    Loading runs in the background: the scheduler asks `state`, and keeps a
    request whose adapter is still loading waiting, without stalling others."""

    def request_load(self, ref: LoRARef) -> None:
        """A request wants `ref`: start loading it if it is not
        loaded or loading; returns at once. NOTE: each call holds the adapter
        (it is never evicted while held) until its matching `release`."""
        ...

    def release(self, digest: str) -> None:
        """One holder of `digest` (a finished request) lets go: once none
        holds it, it may be evicted (a failed load is forgotten, so a later
        request tries again)."""
        ...

    def state(self, digest: str) -> str | None:
        """None: loaded and ready; "loading"; anything else: why it failed."""
        ...

    def weights(self, digest: str) -> dict[str, Tensor]:
        """A ready adapter's tensors, as `LoRASlotLoad.weights` carries them."""
        ...

    def num_loaded(self) -> int:
        """Adapters loaded now (ready ones, in memory)."""
        ...

    def take_load_times(self) -> list[float]:
        """Seconds each load took, for loads finished since the last call."""
        ...

    def wait_for_loads(self, timeout_s: float) -> None:
        """Block until a load finishes or `timeout_s` passes (an engine whose
        every request waits for an adapter must not spin)."""
        ...

    def shutdown(self) -> None:
        """Stop the loading thread (loads not started are dropped)."""
        ...
