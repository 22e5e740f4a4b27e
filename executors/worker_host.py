"""One rank's side of a multi-rank executor: frames in, a Worker's calls, replies out.

The `mp` executor's rank processes (executors/mp_worker.py) and the `ray`
executor's actors both hold a WorkerHost: transport differs, what a frame
means does not. A call that raises becomes an error reply naming the rank;
the host itself never dies of a bad frame.
"""

from __future__ import annotations

import logging
import traceback
from typing import TYPE_CHECKING, Any

from pagedllm.core.errors import ConfigError
from pagedllm.core.scheduler_output import ModelRunnerOutput
from pagedllm.executors.base import Executor
from pagedllm.executors.messages import (
    CallWorker,
    ExecuteModel,
    InitWorker,
    WorkerInputDecoder,
    WorkerReply,
    encoder,
)

if TYPE_CHECKING:
    from pagedllm.core.scheduler_output import KVConnectorMetadata
    from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

# The rank whose step output the executor returns (it samples like every
# rank; the others answer only when a step fails or a KV connector reports).
OUTPUT_RANK = 0


class WorkerHost:
    def __init__(self) -> None:
        self.worker: Worker | None = None
        self.rank = -1
        self.stopped = False
        self.decoder = WorkerInputDecoder(self._metadata_cls)

    def handle(self, frame: bytes | memoryview) -> bytes | None:
        """Run what `frame` asks; the reply to send back (None: no reply due)."""
        method = "decode"
        try:
            message = self.decoder.decode(frame)
            method = _method_of(message)
            return self._dispatch(message)
        except Exception as exc:  # reported to the executor, which ends the engine
            logger.error("rank %d: %s failed:\n%s", self.rank, method, traceback.format_exc())
            config_error = None
            if isinstance(exc, ConfigError):
                value = exc.value if isinstance(exc.value, (int, float, str, bool, type(None))) else str(exc.value)
                config_error = [exc.key, value, exc.allowed]
            return encoder.encode(
                WorkerReply(self.rank, method, error=f"{type(exc).__name__}: {exc}", config_error=config_error)
            )

    def _dispatch(self, message: InitWorker | CallWorker | ExecuteModel) -> bytes | None:
        if isinstance(message, ExecuteModel):
            worker = self._worker()
            output = worker.execute_model(message.step)
            if self.rank != OUTPUT_RANK:
                if worker.kv_connector is None:
                    return None
                # Every rank's connector reports (and its custom figures); the tokens are the output rank's to send.
                output = ModelRunnerOutput(
                    sampled_token_ids={},
                    kv_connector_output=output.kv_connector_output,
                    custom_stats=output.custom_stats,
                )
            return encoder.encode(WorkerReply(self.rank, "execute_model", output=output))
        if isinstance(message, InitWorker):
            self._init_worker(message)
            return encoder.encode(WorkerReply(self.rank, "init"))
        if message.method not in Executor.RPC_METHODS:
            raise ValueError(f"{message.method!r} is not a Worker method the executor may call")
        value: Any = getattr(self._worker(), message.method)(*message.args)
        if message.method == "shutdown":
            self.stopped = True
        return encoder.encode(WorkerReply(self.rank, message.method, value=value))

    def _init_worker(self, message: InitWorker) -> None:
        from pagedllm.core.config import EngineConfig
        from pagedllm.worker.worker import Worker

        self.rank = message.rank
        config = EngineConfig.model_validate_json(message.config_json)
        if config.parallel.tensor_parallel_size != message.world_size:
            raise ValueError(f"world size {message.world_size} != tensor_parallel_size "
                             f"{config.parallel.tensor_parallel_size}")
        self.worker = Worker(
            config,
            rank=message.rank,
            local_rank=message.local_rank,
            distributed_init_method=message.distributed_init_method,
        )

    def _metadata_cls(self) -> type[KVConnectorMetadata] | None:
        """What a step's KV connector metadata decodes into: this rank's connector's class."""
        connector = None if self.worker is None else self.worker.kv_connector
        return None if connector is None else connector.metadata_cls

    def _worker(self) -> Worker:
        if self.worker is None:
            raise RuntimeError("this rank got a call before InitWorker")
        return self.worker


def _method_of(message: InitWorker | CallWorker | ExecuteModel) -> str:
    if isinstance(message, ExecuteModel):
        return "execute_model"
    if isinstance(message, InitWorker):
        return "init"
    return message.method


__all__ = ["OUTPUT_RANK", "WorkerHost"]
