"""The accelerator's own collectives (plugin API 1.3): where a vendor plugs
in its collective library. This stand-in runs torch.distributed's and counts
each call, so a test can see that tensor-parallel layers really come here."""

from __future__ import annotations

from collections import Counter

import torch
from pagedllm.platforms.interface import TorchDistributedCommunicator


class ExampleCommunicator(TorchDistributedCommunicator):
    def __init__(self, group: torch.distributed.ProcessGroup, device: torch.device) -> None:
        super().__init__(group, device)
        self.calls: Counter[str] = Counter()

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        self.calls["all_reduce"] += 1
        return super().all_reduce(input_)

    def all_gather(self, input_: torch.Tensor, dim: int = -1) -> torch.Tensor:
        self.calls["all_gather"] += 1
        return super().all_gather(input_, dim)

    def gather(self, input_: torch.Tensor, dst: int = 0, dim: int = -1) -> torch.Tensor | None:
        self.calls["gather"] += 1
        return super().gather(input_, dst, dim)

    def broadcast(self, input_: torch.Tensor, src: int = 0) -> torch.Tensor:
        self.calls["broadcast"] += 1
        return super().broadcast(input_, src)
