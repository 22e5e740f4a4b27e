"""memory_store's own options (``plugins.config.example_connector``).

Set them in the engine config file (``plugins: {config: {example_connector:
{max_blocks: 1024}}}``), by environment
(``PAGEDLLM_PLUGINS__CONFIG__EXAMPLE_CONNECTOR__MAX_BLOCKS=1024``), by flag
(``--plugin-config example_connector='{"max_blocks": 1024}'``) or
``LLM(plugin_config={"example_connector": {"max_blocks": 1024}})``.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class MemoryStoreOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # The most blocks one store (a namespace, for one model) holds; a
    # producer saves no more once it is full. None = no limit.
    max_blocks: int | None = Field(None, ge=1)
