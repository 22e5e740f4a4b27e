"""mistral_json keeps every rule of pagedllm's tool_parser conformance suite."""

from pagedllm.testing import conformance_tests

test_mistral_json_conformance = conformance_tests("tool_parser", "mistral_json")
