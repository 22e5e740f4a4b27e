"""Reasoning parsers (plugin kind ``reasoning_parser``): split a reasoning
model's output into ``reasoning_content`` and ``content``."""
