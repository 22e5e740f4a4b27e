"""Structured output: grammar backends (a plugin kind), the per-request
Grammar contract, the compile manager and the shared token bitmask."""

from __future__ import annotations

from pagedllm.structured_output.interface import Grammar, GrammarBackend, StructuredOutputKind

__all__ = ["Grammar", "GrammarBackend", "StructuredOutputKind"]
