"""Stat loggers (plugin kind ``stat_logger``): what the API process (and
``LLM``, in-process) does with the engine's statistics. Interface in
``base.py``; built-ins ``prometheus`` (``/metrics``) and ``logging`` (the
periodic throughput line)."""
