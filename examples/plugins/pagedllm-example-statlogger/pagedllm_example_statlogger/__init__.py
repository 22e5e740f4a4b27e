"""pagedllm-example-statlogger: registers the ``jsonl`` stat logger.

Select it with ``--stat-loggers prometheus,logging,jsonl`` (keep the
built-ins you want: the list replaces the default) or
``LLM(stat_loggers=["jsonl"])``. It writes to its plugin option ``path``
(default ``pagedllm-stats.jsonl`` in the working directory):
``--plugin-config example_statlogger='{"path": "/tmp/stats.jsonl"}'``,
``PAGEDLLM_PLUGINS__CONFIG__EXAMPLE_STATLOGGER__PATH=/tmp/stats.jsonl`` or
``plugins: {config: {example_statlogger: {path: ...}}}`` in the config file.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pagedllm.plugins import RegisterFn, hookimpl

# The stat-logger kind is plugin API 1.7.
PAGEDLLM_API_VERSION = ">=1.7,<2"

LOGGER_NAME = "jsonl"


class JsonLinesOptions(BaseModel):
    """The plugin's options (``plugins.config.example_statlogger``)."""

    model_config = ConfigDict(extra="forbid")

    path: str = "pagedllm-stats.jsonl"  # relative: to the server's working directory


PAGEDLLM_PLUGIN_CONFIG = JsonLinesOptions


@hookimpl
def register_stat_loggers(register: RegisterFn) -> None:
    register(LOGGER_NAME, "pagedllm_example_statlogger.logger:JsonLinesStatLogger")
