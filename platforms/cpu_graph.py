"""The CPU graph recorder's old import path, kept for plugins: it lives in
`pagedllm.platforms.cpu.graph` now, and plugin code written against
`pagedllm.platforms.cpu_graph.kernel_call` / `refuse_capture` keeps working."""

from __future__ import annotations

from pagedllm.platforms.cpu.graph import CpuGraph, kernel_call, refuse_capture

__all__ = ["CpuGraph", "kernel_call", "refuse_capture"]
