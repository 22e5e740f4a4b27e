"""Suffix decoding (Oliaro et al. 2024, Arctic Inference's `suffix`).

Two suffix trees with counts (spec_decode/suffix_tree.py): one per request
over its prompt + output, and one global tree over the outputs of the running
requests and of the last `suffix_decoding_max_cached_requests` finished ones
(oldest evicted first). Every step each request's new tokens are appended to
both (O(max_tree_depth) per token; nothing is rebuilt). To draft, every
suffix of the request's tokens that occurred with a continuation is a
candidate, in each tree; from its node the most frequent continuation is
followed greedily for up to int(match length * max_spec_factor +
max_spec_offset) tokens, while its estimated probability stays >=
min_token_prob; the draft that scores highest (the sum of those
probabilities) wins. Shorter matches matter: the trees are cut at
max_tree_depth, so a match of m tokens has max_tree_depth - m levels of
continuation below it. No model, q is one-hot. A
seeded request drafts from its own tree only, so that its tokens do not
depend on the other requests.

A request's tree is dropped when it finishes or is aborted
(`finish_requests`); its output stays in the global tree until evicted.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.spec_decode.interface import Drafter, DrafterContext, DraftInputs, DraftOutput
from pagedllm.spec_decode.suffix_tree import Cursor, SuffixTree

if TYPE_CHECKING:
    from pagedllm.core.config import SpeculativeConfig


@dataclass
class _RequestTrees:
    """What the drafter keeps for one running request."""

    local: SuffixTree  # over prompt + output
    local_cursor: Cursor = field(default_factory=list)
    global_cursor: Cursor = field(default_factory=list)
    num_tokens: int = 0  # tokens appended so far
    # The first call sees the prompt and the first sampled token: the output
    # (what goes into the global tree) starts at num_prompt_tokens.
    num_prompt_tokens: int = 0
    output: list[int] = field(default_factory=list)


class SuffixDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig, context: DrafterContext) -> None:
        super().__init__(config, context)
        self.max_depth = config.suffix_decoding_max_tree_depth
        self.max_cached_requests = config.suffix_decoding_max_cached_requests
        self.global_tree = SuffixTree(self.max_depth)
        self.requests: dict[str, _RequestTrees] = {}
        # Finished requests' outputs still in the global tree, oldest first.
        self.cached_outputs: OrderedDict[str, list[int]] = OrderedDict()

    def propose(self, inputs: DraftInputs) -> DraftOutput:
        k = self.num_speculative_tokens
        max_model_len = self.context.max_model_len if self.context is not None else None
        params = inputs.sampling_params
        drafts = []
        for i, (req_id, token_ids) in enumerate(zip(inputs.req_ids, inputs.token_ids, strict=True)):
            trees = self._update(req_id, token_ids)
            wanted = inputs.num_drafts[i] if inputs.num_drafts else k  # the policy's count
            num_drafts = wanted if max_model_len is None else max(0, min(wanted, max_model_len - len(token_ids)))
            # A seeded request drafts from its own tokens only: which drafts it
            # gets decides which random numbers it draws, and those must not
            # depend on the other requests (its tokens are the same alone or
            # in any batch).
            own_only = bool(params) and params[i].seed is not None
            drafts.append(self._draft(trees, token_ids, num_drafts, own_only) if num_drafts else [])
        return DraftOutput(drafts)

    def _update(self, req_id: str, token_ids: Sequence[int]) -> _RequestTrees:
        """Append the request's tokens not yet seen to its tree and the global one."""
        trees = self.requests.get(req_id)
        if trees is None:
            trees = self.requests[req_id] = _RequestTrees(SuffixTree(self.max_depth))
            trees.num_prompt_tokens = max(0, len(token_ids) - 1)
        new = token_ids[trees.num_tokens :]
        trees.local.extend(trees.local_cursor, new)
        trees.num_tokens = len(token_ids)
        if self.max_cached_requests > 0:
            new_output = token_ids[max(trees.num_prompt_tokens, len(token_ids) - len(new)) :]
            self.global_tree.extend(trees.global_cursor, new_output)
            trees.output.extend(new_output)
        return trees

    def _draft(self, trees: _RequestTrees, token_ids: Sequence[int], num_drafts: int, own_only: bool) -> list[int]:
        """The best-scoring draft over the match lengths of both trees, from
        the longest down to the longest with room below it for the whole
        draft (max_tree_depth - num_drafts): shorter matches are less
        specific contexts, and trying them all (Arctic's speculate tries every
        start of the pattern) cost ~2 ms a step at batch 32 in Python."""
        config = self.config
        full_room = self.max_depth - num_drafts
        best: list[int] = []
        best_score = 0.0
        sources = [(trees.local, trees.local.cursor_matches(trees.local_cursor))]
        if self.max_cached_requests > 0 and not own_only:
            sources.append((self.global_tree, self.global_tree.matches(token_ids)))
        for tree, matches in sources:
            for node, match_len in matches:
                limit = min(num_drafts, int(match_len * config.suffix_decoding_max_spec_factor
                                            + config.suffix_decoding_max_spec_offset))
                if limit <= best_score:
                    break  # a score is at most the draft's length, and shorter matches allow no more
                draft, score = tree.greedy_draft(node, limit, config.suffix_decoding_min_token_prob)
                if score > best_score:
                    best, best_score = draft, score
                if match_len <= full_room:
                    break
        return best

    def finish_requests(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            trees = self.requests.pop(req_id, None)
            if trees is None or self.max_cached_requests == 0:
                continue
            reused = self.cached_outputs.pop(req_id, None)  # an id used again
            if reused is not None:
                self.global_tree.remove(reused)
            self.cached_outputs[req_id] = trees.output
            while len(self.cached_outputs) > self.max_cached_requests:
                _, evicted = self.cached_outputs.popitem(last=False)
                self.global_tree.remove(evicted)
