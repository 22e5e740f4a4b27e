"""The test plugin's own options (``plugins.config.pagedllm_test_plugin``):
one field of each shape a user sets (a path, a bounded int, a choice, a list),
so the tests can check each one's validation and where it ends up."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class TestPluginOptions(BaseModel):
    __test__ = False  # not a pytest test class
    model_config = ConfigDict(extra="forbid")

    # Where the test_echo backend writes the options it was handed, with its
    # process id (so a test sees which process built it); None = nowhere.
    record_path: str | None = None
    label: str = "default"
    scale: int = Field(1, ge=1, le=8)
    mode: Literal["fast", "exact"] = "exact"
    tiers: list[int] = Field(default_factory=list)
