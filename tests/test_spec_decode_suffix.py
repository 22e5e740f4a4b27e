"""Suffix decoding: the suffix tree's counts and matches, the drafter's
continuation choice, eviction bounds and freeing."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from pagedllm.core.config import SpeculativeConfig
from pagedllm.spec_decode.interface import DraftInputs
from pagedllm.spec_decode.suffix import SuffixDrafter
from pagedllm.spec_decode.suffix_tree import ROOT, SuffixTree


def _window_counts(sequences: list[list[int]], max_depth: int) -> dict[tuple[int, ...], int]:
    """Reference: occurrences of every window of up to max_depth tokens."""
    counts: dict[tuple[int, ...], int] = {}
    for tokens in sequences:
        for start in range(len(tokens)):
            for end in range(start + 1, min(start + max_depth, len(tokens)) + 1):
                key = tuple(tokens[start:end])
                counts[key] = counts.get(key, 0) + 1
    return counts


def _tree_counts(tree: SuffixTree) -> dict[tuple[int, ...], int]:
    counts: dict[tuple[int, ...], int] = {}
    stack = [((), ROOT)]
    while stack:
        path, node = stack.pop()
        for token, child in tree.children(node).items():
            counts[path + (token,)] = tree.count(child)
            stack.append((path + (token,), child))
    return counts


def _drafter(**overrides: object) -> SuffixDrafter:
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=4, **overrides)  # type: ignore[arg-type]
    return SuffixDrafter(config, SimpleNamespace(max_model_len=10_000))  # type: ignore[arg-type]


def test_incremental_appends_count_every_window_once() -> None:
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 4, size=int(rng.integers(1, 40))).tolist() for _ in range(5)]
    tree = SuffixTree(max_depth=5)
    for tokens in sequences:
        cursor: list = []
        for start in range(0, len(tokens), 3):  # appended a few tokens at a time
            tree.extend(cursor, tokens[start : start + 3])
    assert _tree_counts(tree) == _window_counts(sequences, 5)
    assert tree.num_nodes == 1 + len(_window_counts(sequences, 5))


def test_remove_leaves_the_other_sequences_exactly() -> None:
    rng = np.random.default_rng(1)
    sequences = [rng.integers(0, 3, size=30).tolist() for _ in range(4)]
    tree = SuffixTree(max_depth=4)
    for tokens in sequences:
        tree.extend([], tokens)
    tree.remove(sequences[1])
    tree.remove(sequences[3])
    kept = [sequences[0], sequences[2]]
    assert _tree_counts(tree) == _window_counts(kept, 4)
    assert tree.num_nodes == 1 + len(_window_counts(kept, 4))
    tree.remove(sequences[0])
    tree.remove(sequences[2])
    assert tree.children(ROOT) == {} and tree.num_nodes == 1 and tree.count(ROOT) == 0


def test_matches_are_the_suffixes_with_a_continuation_longest_first() -> None:
    tree = SuffixTree(max_depth=8)
    tree.extend([], [1, 2, 3, 4, 9, 2, 3, 5])
    # [1, 2, 3] is followed by 4; [2, 3] by 4 and 5; [3] by 4 and 5.
    found = [(length, sorted(tree.children(node))) for node, length in tree.matches([7, 1, 2, 3])]
    assert found == [(3, [4]), (2, [4, 5]), (1, [4, 5])]
    assert list(tree.matches([6, 6])) == []


def test_cursor_matches_skip_the_context_itself() -> None:
    tree = SuffixTree(max_depth=6)
    cursor: list = []
    tree.extend(cursor, [5, 6, 7, 8, 0, 6, 7])  # [6, 7] and [7] occurred before, followed by 8
    found = [(length, list(tree.children(node))) for node, length in tree.cursor_matches(cursor)]
    assert found == [(2, [8]), (1, [8])]


def test_greedy_draft_follows_the_most_frequent_child_until_unlikely() -> None:
    tree = SuffixTree(max_depth=6)
    for tokens in ([1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 5, 6], [1, 7]):
        tree.extend([], tokens)
    node = tree.find([1])  # count 4: 2 (x3), 7 (x1)
    assert node is not None
    assert tree.greedy_draft(node, 5, 0.0) == ([2, 3, 4], 3 / 4 + 2 / 4 + 2 / 4)
    assert tree.greedy_draft(node, 5, 0.6) == ([2], 3 / 4)
    assert tree.greedy_draft(node, 1, 0.0) == ([2], 3 / 4)


def test_drafter_proposes_the_repeated_continuation() -> None:
    drafter = _drafter()
    tokens = [10, 11, 12, 13, 14, 15, 20, 10, 11, 12]
    out = drafter.propose(DraftInputs(req_ids=["a"], token_ids=[tokens], sampling_params=[]))
    # Match [10, 11, 12] (length 3): at most 3 drafts, the tokens that followed.
    assert out.draft_token_ids == [[13, 14, 15]]


def test_spec_factor_and_offset_bound_the_draft_by_the_match() -> None:
    tokens = [10, 11, 12, 13, 14, 15, 20, 10, 11, 12]
    inputs = DraftInputs(req_ids=["a"], token_ids=[tokens], sampling_params=[])
    assert _drafter(suffix_decoding_max_spec_factor=0.5).propose(inputs).draft_token_ids == [[13]]
    offset = _drafter(suffix_decoding_max_spec_factor=0.5, suffix_decoding_max_spec_offset=2)
    assert offset.propose(inputs).draft_token_ids == [[13, 14, 15]]


def test_global_tree_drafts_from_a_finished_requests_output() -> None:
    drafter = _drafter()
    prompt = [1, 2]
    output = [30, 31, 32, 33, 34, 35]
    for i in range(1, len(output) + 1):  # decode "a" one token per step
        drafter.propose(DraftInputs(req_ids=["a"], token_ids=[prompt + output[:i]], sampling_params=[]))
    drafter.finish_requests({"a"})
    assert "a" not in drafter.requests
    out = drafter.propose(DraftInputs(req_ids=["b"], token_ids=[[9, 9, 30, 31, 32]], sampling_params=[]))
    assert out.draft_token_ids == [[33, 34, 35]]
    # Only outputs go into the global tree: a's prompt is not there.
    assert drafter.global_tree.find([1]) is None


def test_global_tree_keeps_the_last_requests_only() -> None:
    drafter = _drafter(suffix_decoding_max_cached_requests=2)
    outputs = {name: [100 + 10 * i + j for j in range(6)] for i, name in enumerate("abc")}
    for name, output in outputs.items():
        # The first call: prompt [0] + the first sampled token; then the rest.
        drafter.propose(DraftInputs(req_ids=[name], token_ids=[[0] + output[:1]], sampling_params=[]))
        drafter.propose(DraftInputs(req_ids=[name], token_ids=[[0] + output], sampling_params=[]))
        drafter.finish_requests({name})
    assert list(drafter.cached_outputs) == ["b", "c"]
    assert drafter.global_tree.find([outputs["a"][0]]) is None  # evicted: its nodes are gone
    assert drafter.global_tree.find(outputs["c"]) is not None
    assert drafter.global_tree.num_nodes == 1 + len(_window_counts([outputs["b"], outputs["c"]], 24))


def test_finished_and_unknown_requests_are_freed_without_error() -> None:
    drafter = _drafter(suffix_decoding_max_cached_requests=0)
    drafter.propose(DraftInputs(req_ids=["a", "b"], token_ids=[[1, 2, 1], [3, 4, 3]], sampling_params=[]))
    drafter.finish_requests({"a", "never-seen"})
    assert set(drafter.requests) == {"b"}
    assert drafter.global_tree.num_nodes == 1 and not drafter.cached_outputs


def test_seeded_request_drafts_from_its_own_tokens_only() -> None:
    from pagedllm import SamplingParams

    drafter = _drafter()
    drafter.propose(DraftInputs(req_ids=["a"], token_ids=[[0, 30]], sampling_params=[]))
    drafter.propose(DraftInputs(req_ids=["a"], token_ids=[[0, 30, 31, 32, 33]], sampling_params=[]))
    inputs = [[9, 30, 31]] * 2
    params = [SamplingParams(seed=5), SamplingParams()]
    out = drafter.propose(DraftInputs(req_ids=["s", "u"], token_ids=inputs, sampling_params=params))
    # The unseeded one follows a's output in the global tree; the seeded one
    # has nothing of its own to match.
    assert out.draft_token_ids == [[], [32, 33]]


def test_a_shorter_match_wins_when_the_longest_has_no_room_below_it() -> None:
    # Depth 6: the 5-token match [1..5] sits at the tree's last level but one,
    # so it can draft 1 token; [3, 4, 5] has 3 levels below it and may draft 3
    # (match length x max_spec_factor 1), [4, 5] only 2.
    drafter = _drafter(suffix_decoding_max_tree_depth=6)
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 5]
    out = drafter.propose(DraftInputs(req_ids=["a"], token_ids=[tokens], sampling_params=[]))
    assert out.draft_token_ids == [[6, 7, 8]]


def test_removals_and_reused_nodes_keep_counts_and_the_most_frequent_child() -> None:
    """Remove and add sequences in turn (freed node ids are reused): the
    counts stay every window's, and each node's first draft token is a
    child of the highest count."""
    rng = np.random.default_rng(2)
    tree = SuffixTree(max_depth=4)
    live: list[list[int]] = []
    for _ in range(40):
        if live and rng.random() < 0.4:
            tree.remove(live.pop(int(rng.integers(0, len(live)))))
        else:
            tokens = rng.integers(0, 5, size=int(rng.integers(1, 25))).tolist()
            tree.extend([], tokens)
            live.append(tokens)
        assert _tree_counts(tree) == _window_counts(live, 4)
        assert tree.num_nodes == 1 + len(_window_counts(live, 4))
        stack = [ROOT]
        while stack:
            node = stack.pop()
            children = tree.children(node)
            stack.extend(children.values())
            if children:
                (token,), _ = tree.greedy_draft(node, 1, 0.0)
                assert tree.count(children[token]) == max(tree.count(c) for c in children.values())
