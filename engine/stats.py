"""The front end's statistics types, kept at their old import path: stat
loggers (plugin kind ``stat_logger``) annotate with
``pagedllm.engine.stats.IterationStats``. They live in `pagedllm.core.stats`."""

from pagedllm.core.stats import FinishedRequestStats, IterationStats

__all__ = ["FinishedRequestStats", "IterationStats"]
