"""The sdpa backend keeps every rule of pagedllm's attention backend conformance suite."""

from pagedllm.testing import conformance_tests

test_sdpa_conformance = conformance_tests("attention_backend", "sdpa")
