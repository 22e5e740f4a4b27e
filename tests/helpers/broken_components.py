"""Deliberately broken plugins: each keeps every conformance rule of its
kind but one, which the conformance kit must name (tests/test_conformance_kit.py).

Registered with ``pm.register(BrokenPlugin(), name=...)``; the components are
classes defined here, so no entry point or pip install is involved.
"""

from __future__ import annotations

from typing import Any

from pagedllm.attention_backends.base import AttentionImpl
from pagedllm.attention_backends.torch_native import TorchNativeAttentionImpl, TorchNativeBackend
from pagedllm.kv_connectors.cpu_offload import CpuOffloadConnector
from pagedllm.plugins import RegisterFn, hookimpl
from pagedllm.spec_decode.interface import DraftInputs, DraftOutput
from pagedllm.spec_decode.ngram import NgramDrafter

BACKEND = "conformance_broken_window"
DRAFTER = "conformance_broken_order"
CONNECTOR = "conformance_broken_hold"


class WindowlessImpl(TorchNativeAttentionImpl):
    """Declares sliding-window support, then attends over the whole context."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.sliding_window = None


class WindowlessBackend(TorchNativeBackend):
    name = BACKEND

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return WindowlessImpl


class ReversedBatchDrafter(NgramDrafter):
    """Right drafts, handed to the requests in reverse batch order."""

    def propose(self, inputs: DraftInputs) -> DraftOutput:
        output = super().propose(inputs)
        return DraftOutput(output.draft_token_ids[::-1])


class NeverReleasingConnector(CpuOffloadConnector):
    """Keeps every finished request's blocks (request_finished True) and
    never reports the save done: the blocks are never freed."""

    def request_finished(self, request: Any, block_ids: list[int]) -> bool:
        super().request_finished(request, block_ids)
        return True


class BrokenPlugin:
    @hookimpl
    def register_attention_backends(self, register: RegisterFn) -> None:
        register(BACKEND, WindowlessBackend, device_types=["cpu", "cuda"], dtypes=["float32"],
                 supports_sliding_window=True)

    @hookimpl
    def register_drafters(self, register: RegisterFn) -> None:
        register(DRAFTER, ReversedBatchDrafter, needs_model=False)

    @hookimpl
    def register_kv_connectors(self, register: RegisterFn) -> None:
        register(CONNECTOR, NeverReleasingConnector, roles=["both"])
