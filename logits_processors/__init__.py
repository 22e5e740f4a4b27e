"""Logits processors (plugin kind ``logits_processor``): batch-level
transformations of the logits before sampling, with per-request arguments.
The interface is :mod:`pagedllm.logits_processors.interface`."""
