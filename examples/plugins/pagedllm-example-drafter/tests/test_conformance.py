"""suffix_window keeps every rule of pagedllm's drafter conformance suite."""

from pagedllm.testing import conformance_tests

test_suffix_window_conformance = conformance_tests("drafter", "suffix_window")
