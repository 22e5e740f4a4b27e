"""`LoRARequest`: an adapter as offline callers name it (vLLM's type)."""

from __future__ import annotations

import msgspec

from pagedllm.core.errors import InvalidRequestError


class LoRARequest(msgspec.Struct, frozen=True):
    """`LLM.generate(..., lora_request=LoRARequest("sql", 1, "/adapters/sql"))`.

    `lora_int_id` is vLLM's positive adapter id, kept for compatibility:
    pagedllm identifies an adapter by its content (docs/lora.md), so two
    requests with the same files share cached KV whatever their ids."""

    lora_name: str
    lora_int_id: int
    lora_path: str
    # The model the adapter is listed under (`/v1/models`' parent).
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise InvalidRequestError("lora_name", self.lora_name, "a non-empty name")
        if self.lora_int_id < 1:
            raise InvalidRequestError("lora_int_id", self.lora_int_id, "a positive integer (vLLM's rule)")
        if not self.lora_path:
            raise InvalidRequestError("lora_path", self.lora_path, "the adapter's folder")

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
