"""The suffix_window drafter: exact proposals, and found through the entry point."""

from __future__ import annotations

import random

import pytest

from pagedllm_example_drafter.drafter import suffix_window_propose


def test_most_recent_match_wins() -> None:
    # Suffix [1, 2] occurs at 0 (followed by 7) and at 3 (followed by 8).
    assert suffix_window_propose([1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 1, window=100) == [8]


def test_longest_suffix_wins_and_the_window_bounds_the_search() -> None:
    tokens = [5, 6, 9, 4, 6, 3, 5, 6]
    assert suffix_window_propose(tokens, 1, 2, 1, window=100) == [9]  # the bigram [5, 6]
    # A window of 6 no longer sees the first [5, 6]; the unigram 6 (recent) remains.
    assert suffix_window_propose(tokens, 1, 2, 1, window=6) == [3]


def test_nothing_without_a_match() -> None:
    assert suffix_window_propose([], 1, 3, 3, window=10) == []
    assert suffix_window_propose([1, 2, 3], 1, 3, 3, window=10) == []


def test_selected_by_name_and_greedy_output_is_unchanged() -> None:
    from pagedllm import LLM, SamplingParams
    from pagedllm.plugins import get_plugin_manager

    get_plugin_manager().load()
    if "suffix_window" not in get_plugin_manager().registry("drafter"):
        pytest.skip("the package is not installed (pip install -e examples/plugins/pagedllm-example-drafter)")
    rng = random.Random(0)
    span = [rng.randrange(10, 400) for _ in range(6)]
    prompts = [[rng.randrange(10, 400)] + span * 3 + [rng.randrange(10, 400)] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    requests = [{"prompt_token_ids": p} for p in prompts]
    plain = LLM(model="tiny", num_kv_blocks=64).generate(requests, params, use_tqdm=False)
    spec_llm = LLM(model="tiny", num_kv_blocks=64,
                   speculative_config={"method": "suffix_window", "num_speculative_tokens": 3})
    speculative = spec_llm.generate(requests, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in speculative] == [o.outputs[0].token_ids for o in plain]
    assert spec_llm.engine_core.engine_core.scheduler.total_spec_decoding_stats.num_draft_tokens > 0
