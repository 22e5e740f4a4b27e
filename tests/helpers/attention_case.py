"""The paged-attention batch builder now ships in the conformance kit
(`pagedllm.testing.attention_case`), whose attention suite runs it against
every backend; the repository's own tests import it from here as before."""

from __future__ import annotations

from pagedllm.testing.attention_case import DEVICE, AttentionCase, build_case, paged_metadata, run_backend

__all__ = ["DEVICE", "AttentionCase", "build_case", "paged_metadata", "run_backend"]
