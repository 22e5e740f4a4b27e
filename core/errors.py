"""Typed errors. User errors carry the field, the value and the limit so the
HTTP layer can turn them into OpenAI-shaped 400s without parsing messages."""

from __future__ import annotations

from typing import Any


class PagedLLMError(Exception):
    """Base class of every error pagedllm raises on purpose."""


class InvalidRequestError(PagedLLMError, ValueError):
    """A request (prompt, sampling parameters) the user can fix."""

    def __init__(self, field: str, value: Any, limit: str) -> None:
        self.field = field
        self.value = value
        self.limit = limit
        super().__init__(f"{field}={value!r} is invalid: {limit}")


class ConfigError(PagedLLMError, ValueError):
    """An engine configuration key or value that is not allowed."""

    def __init__(self, key: str, value: Any, allowed: str) -> None:
        self.key = key
        self.value = value
        self.allowed = allowed
        super().__init__(f"{key}={value!r} is invalid; allowed: {allowed}")


class PluginError(PagedLLMError):
    """A plugin failed to load, collided with another, or is incompatible."""


class UnknownComponentError(PagedLLMError, KeyError):
    """A component name that no plugin registered."""

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind = kind
        self.name = name
        self.known = known
        super().__init__(f"no {kind} named {name!r}; registered: {', '.join(sorted(known)) or '(none)'}")

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class AttentionBackendError(PagedLLMError):
    """The configured attention backend cannot run here; carries every reason."""

    def __init__(self, name: str, reasons: list[str]) -> None:
        self.name = name
        self.reasons = reasons
        super().__init__(f"attention backend {name!r} is not usable here: " + "; ".join(reasons))


class EngineDeadError(PagedLLMError, RuntimeError):
    """The engine-core process (or thread) died; nothing in flight will finish.
    The HTTP layer answers 503 (and ends a stream with an error chunk).
    `failed_rank`: the executor rank whose failure ended it, when one did."""

    def __init__(self, message: str, *, failed_rank: int | None = None) -> None:
        super().__init__(message)
        self.failed_rank = failed_rank


class ServerShuttingDownError(EngineDeadError):
    """The server is shutting down and ended a request its drain timeout did
    not let finish. An EngineDeadError so every path that answers a dead
    engine with 503 (and a stream with an error chunk) answers this too."""


class EngineUnresponsiveError(PagedLLMError):
    """The engine core is alive but did not answer a health ping in time
    (stopped, wedged in a kernel, deadlocked); /health answers 503."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        super().__init__(
            f"the engine core did not answer a health check within {timeout_s:g} s (server.health_timeout_s)"
        )


class EngineOverloadedError(PagedLLMError):
    """Too many unfinished sequences (`server.max_pending_requests` counts
    prompts x n); retry later (503)."""

    def __init__(self, num_pending: int, limit: int, num_requested: int = 1) -> None:
        self.num_pending = num_pending
        self.limit = limit
        self.num_requested = num_requested
        super().__init__(
            f"the engine has {num_pending} unfinished sequences and this request adds {num_requested}; "
            f"the limit (server.max_pending_requests) is {limit}; retry later"
        )


class EngineStartupError(PagedLLMError, RuntimeError):
    """The engine core failed to start (bad model path or config, timeout);
    `error_type` names the exception the core raised, if any."""

    def __init__(self, message: str, error_type: str | None = None) -> None:
        self.error_type = error_type
        super().__init__(message)


class GraphCaptureError(PagedLLMError):
    """A decode forward that cannot be captured as a replayable graph on
    this platform; the worker logs it and runs every step eagerly."""


class KVTransferError(PagedLLMError):
    """A KV block from a connector could not be loaded under
    `kv_transfer.load_failure_policy: fail`; fails that request alone."""

    def __init__(self, connector: str, block_hash: str, reason: str) -> None:
        self.connector = connector
        self.block_hash = block_hash
        self.reason = reason
        super().__init__(f"kv_transfer connector {connector!r} could not load block {block_hash}: {reason}")
