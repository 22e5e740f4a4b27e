"""A stat logger that appends one JSON object per line to a file:

- ``{"event": "engine_initialized", "model_name", "num_kv_blocks", "custom_metrics": [...]}``
- ``{"event": "step", "time", "num_scheduled_tokens", "scheduler": {...} | null,
  "iteration": {...} | null}``: every batch of engine-core outputs, with the
  scheduler stats as the engine sent them (``custom_stats`` included) and the
  iteration's token counts and latencies;
- ``{"event": "finished", "time", ...FinishedRequestStats}``: one per finished request.

The path: the ``path`` argument, else the plugin option ``path``
(``JsonLinesOptions``; default ``pagedllm-stats.jsonl`` in the working
directory). Each line is flushed as it
is written, so a reader (``tail -f``, a test) sees it at once.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import IO, Any

import msgspec
from pagedllm_example_statlogger import JsonLinesOptions

from pagedllm.plugins import get_plugin_manager
from pagedllm.stat_loggers.base import StatLoggerBase, StatLoggerContext


class JsonLinesStatLogger(StatLoggerBase):
    def __init__(self, context: StatLoggerContext, path: str | None = None) -> None:
        super().__init__(context)
        self.path = path or get_plugin_manager().plugin_config(JsonLinesOptions).path
        self._file: IO[str] | None = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - closed in shutdown
        self._lock = threading.Lock()

    def record(self, scheduler_stats: Any, iteration_stats: Any, num_scheduled_tokens: int | None = None) -> None:
        now = time.time()
        iteration = None
        if iteration_stats is not None:
            iteration = {k: v for k, v in dataclasses.asdict(iteration_stats).items() if k != "finished_requests"}
        self._write({
            "event": "step",
            "time": now,
            "num_scheduled_tokens": num_scheduled_tokens,
            "scheduler": None if scheduler_stats is None else _struct_to_dict(scheduler_stats),
            "iteration": iteration,
        })
        for finished in [] if iteration_stats is None else iteration_stats.finished_requests:
            self._write({"event": "finished", "time": now, **dataclasses.asdict(finished)})

    def log_engine_initialized(self) -> None:
        self._write({
            "event": "engine_initialized",
            "model_name": self.context.model_name,
            "num_kv_blocks": self.context.num_kv_blocks,
            "custom_metrics": [msgspec.to_builtins(spec) for spec in self.context.custom_metrics],
        })

    def shutdown(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None

    def _write(self, payload: dict[str, Any]) -> None:
        line = json.dumps(payload, separators=(",", ":"))
        with self._lock:
            if self._file is None:  # shut down: nothing more is written
                return
            self._file.write(line + "\n")
            self._file.flush()


def _struct_to_dict(struct: msgspec.Struct) -> dict[str, Any]:
    # The structs are array_like on the wire; a log line wants field names.
    return {
        field: _struct_to_dict(value) if isinstance(value, msgspec.Struct) else msgspec.to_builtins(value)
        for field in struct.__struct_fields__
        for value in [getattr(struct, field)]
    }
