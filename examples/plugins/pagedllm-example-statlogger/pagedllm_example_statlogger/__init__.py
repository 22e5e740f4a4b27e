"""pagedllm-example-statlogger: registers the ``jsonl`` stat logger.

Select it with ``--stat-loggers prometheus,logging,jsonl`` (keep the
built-ins you want: the list replaces the default) or
``LLM(stat_loggers=["jsonl"])``. It writes to ``$PAGEDLLM_STATS_JSONL``
(default ``pagedllm-stats.jsonl`` in the working directory).
"""

from __future__ import annotations

from pagedllm.plugins import RegisterFn, hookimpl

# The stat-logger kind is plugin API 1.7.
PAGEDLLM_API_VERSION = ">=1.7,<2"

LOGGER_NAME = "jsonl"


@hookimpl
def register_stat_loggers(register: RegisterFn) -> None:
    register(LOGGER_NAME, "pagedllm_example_statlogger.logger:JsonLinesStatLogger")
