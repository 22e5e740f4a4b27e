"""Clients of EngineCore. The front end (LLM, the HTTP server) talks to the
core only through this interface, so the core can run in-process (here) or in
its own process behind ZMQ (the server issue) without the front end changing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.engine import EngineCore
    from pagedllm.core.outputs import EngineCoreOutput
    from pagedllm.core.request import Request
    from pagedllm.core.scheduler import SchedulerStats


class EngineCoreClient(ABC):
    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self) -> list[EngineCoreOutput]:
        """Outputs of the next engine step (empty when the core is idle)."""

    @abstractmethod
    def get_stats(self) -> SchedulerStats: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool: ...

    def shutdown(self) -> None:
        """Release the core (no-op in-process)."""


class InprocClient(EngineCoreClient):
    """Runs EngineCore in the caller's thread: one step per get_output()."""

    def __init__(self, config: EngineConfig) -> None:
        from pagedllm.core.engine import EngineCore

        self.engine_core: EngineCore = EngineCore(config)

    def add_request(self, request: Request) -> None:
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.engine_core.abort_requests(request_ids)

    def get_output(self) -> list[EngineCoreOutput]:
        if not self.engine_core.has_unfinished_requests():
            return []
        return self.engine_core.step()

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.make_stats()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()
