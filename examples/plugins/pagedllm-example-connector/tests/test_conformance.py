"""memory_store keeps every rule of pagedllm's KV connector conformance suite."""

from pagedllm.testing import conformance_tests

test_memory_store_conformance = conformance_tests("kv_connector", "memory_store")
