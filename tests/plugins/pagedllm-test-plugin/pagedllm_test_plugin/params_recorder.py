"""``record_params``: a request with ``extra_args={"record_params_to": path}``
has the SamplingParams its rank received appended to `path`, one JSON line per
request and rank (with the rank's process id), so a test can compare what a
rank got with what the API built (tests/test_params_reach_ranks.py)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import msgspec
import torch

from pagedllm.core.errors import InvalidRequestError
from pagedllm.logits_processors.interface import BatchUpdate, LogitsProcessor, extra_arg

if TYPE_CHECKING:
    from pagedllm.core.config import EngineConfig
    from pagedllm.core.sampling_params import SamplingParams

ARG = "record_params_to"


class RecordParams(LogitsProcessor):
    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        pass

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        path = extra_arg(params, ARG)
        if path is not None and not isinstance(path, str):
            raise InvalidRequestError(f"extra_args.{ARG}", path, "must be a file path")

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for added in batch_update.added if batch_update is not None else ():
            path = extra_arg(added.params, ARG)
            if path is not None:
                line = msgspec.json.encode({
                    "pid": os.getpid(),
                    "type": f"{type(added.params).__module__}.{type(added.params).__qualname__}",
                    "params": added.params,
                })
                with open(path, "ab") as handle:
                    handle.write(line + b"\n")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
