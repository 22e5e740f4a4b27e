"""A depth-bounded suffix tree with counts (suffix decoding's structure).

Every window ``tokens[i : i + d]`` (``d <= max_depth``) of the sequences added
is a path from the root; a node's count is how many times its path occurs.
That is a suffix trie cut at ``max_depth``: enough to match the last
``max_depth - 1`` tokens of a context and follow the most frequent
continuation. A sequence grows one token at a time through a `Cursor` (the
nodes of its last ``max_depth - 1`` suffixes), so appending a token costs
``O(max_depth)`` and nothing is ever rebuilt; removing a sequence walks its
windows once and drops the nodes no other sequence uses.

Nodes are integers, their fields a few flat lists of ints and their edges
one dict of ints: the tree creates no object per node for the garbage
collector to track. With a Node object and a dict of children per node
(~24 nodes a token), the collector ran through the tree: inserting a
192-token prompt took 13 ms instead of 1.3 ms inside an engine's heap, and
every full collection walked every node of every cached request.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

# The nodes of a sequence's suffixes that may still grow: cursor[m - 1] is the
# node of its last m tokens, for m < max_depth (longest last).
Cursor = list[int]

ROOT = 0
_NONE = -1
_TOKEN_BITS = 32


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        # (node << 32 | token) -> child: ints only, untracked by the collector.
        self._edges: dict[int, int] = {}
        # Per node: its count, its token (the edge into it), first child,
        # siblings (a doubly linked list of its parent's children) and its most
        # frequent child (ties: the one that got there first).
        self._count = [0]
        self._token = [_NONE]
        self._first_child = [_NONE]
        self._next_sibling = [_NONE]
        self._prev_sibling = [_NONE]
        self._best_child = [_NONE]
        self._free: list[int] = []  # ids of removed nodes, reused first
        self.num_nodes = 1

    # ----------------------------------------------------------------- reads

    def count(self, node: int) -> int:
        return self._count[node]

    def has_children(self, node: int) -> bool:
        return self._first_child[node] != _NONE

    def children(self, node: int) -> dict[int, int]:
        """token -> child node."""
        children = {}
        child = self._first_child[node]
        while child != _NONE:
            children[self._token[child]] = child
            child = self._next_sibling[child]
        return children

    def find(self, path: Sequence[int]) -> int | None:
        """The node of `path` (None: it never occurred)."""
        node = ROOT
        edges = self._edges
        for token in path:
            child = edges.get(node << _TOKEN_BITS | token)
            if child is None:
                return None
            node = child
        return node

    def matches(self, context: Sequence[int]) -> Iterator[tuple[int, int]]:
        """(node, m) for every suffix of `context` (m < max_depth tokens)
        that occurs followed by something, longest first. A match of m
        tokens leaves max_depth - m levels of continuation below it, so the
        longest match is not always the one with the longest draft."""
        for m in range(self._longest_match_length(context), 0, -1):
            node = self.find(context[len(context) - m :])
            if node is not None and self.has_children(node):
                yield node, m

    def _longest_match_length(self, context: Sequence[int]) -> int:
        """The longest suffix of `context` that occurs followed by
        something. Such suffixes are closed under shortening, so binary search."""
        low, high = 0, min(len(context), self.max_depth - 1)
        while low < high:
            mid = (low + high + 1) // 2
            node = self.find(context[len(context) - mid :])
            if node is not None and self.has_children(node):
                low = mid
            else:
                high = mid - 1
        return low

    def cursor_matches(self, cursor: Cursor) -> Iterator[tuple[int, int]]:
        """`matches` for the sequence the cursor belongs to: its suffixes that
        occurred earlier with a continuation, longest first."""
        for m in range(len(cursor), 0, -1):
            if self.has_children(cursor[m - 1]):
                yield cursor[m - 1], m

    def greedy_draft(self, node: int, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
        """(tokens, score): from `node`, follow the most frequent child while
        the path's estimated probability (the product of child count / parent
        count) stays >= min_token_prob; score is the sum of those probabilities."""
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        count, best_child, token = self._count, self._best_child, self._token
        while len(tokens) < max_tokens:
            child = best_child[node]
            if child == _NONE:
                break
            prob *= count[child] / count[node]
            if prob < min_token_prob:
                break
            tokens.append(token[child])
            score += prob
            node = child
        return tokens, score

    # ---------------------------------------------------------------- writes

    def extend(self, cursor: Cursor, tokens: Sequence[int]) -> None:
        """Append `tokens` to the sequence whose suffixes `cursor` holds."""
        keep = self.max_depth - 1
        get, count, best_child, add_child = self._edges.get, self._count, self._best_child, self._add_child
        for token in tokens:
            count[ROOT] += 1
            grown = []
            for node in (ROOT, *cursor):  # every suffix grows by `token`, up to depth max_depth
                child = get(node << _TOKEN_BITS | token)
                if child is None:
                    child = add_child(node, token)
                child_count = count[child] + 1
                count[child] = child_count
                best = best_child[node]
                if best != child and (best == _NONE or child_count > count[best]):
                    best_child[node] = child
                grown.append(child)
            cursor[:] = grown[:keep]

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `extend` of these tokens (a whole sequence, as added). A
        node's count is at most its parent's, so a node that reaches 0 here
        has no other descendants than the ones this window reaches next."""
        edges, count = self._edges, self._count
        for start in range(len(tokens)):
            count[ROOT] -= 1
            node = ROOT
            for token in tokens[start : start + self.max_depth]:
                child = edges[node << _TOKEN_BITS | token]
                count[child] -= 1
                if count[child] == 0:
                    self._unlink(node, child)
                if self._best_child[node] == child:
                    self._best_child[node] = self._most_frequent_child(node)
                node = child

    def _add_child(self, node: int, token: int) -> int:
        if self._free:
            child = self._free.pop()
            self._count[child] = 0
            self._first_child[child] = self._best_child[child] = _NONE
            self._token[child] = token
        else:
            child = len(self._count)
            self._count.append(0)
            self._token.append(token)
            for column in (self._first_child, self._next_sibling, self._prev_sibling, self._best_child):
                column.append(_NONE)
        first = self._first_child[node]
        self._next_sibling[child], self._prev_sibling[child] = first, _NONE
        if first != _NONE:
            self._prev_sibling[first] = child
        self._first_child[node] = child
        self._edges[node << _TOKEN_BITS | token] = child
        self.num_nodes += 1
        return child

    def _unlink(self, node: int, child: int) -> None:
        del self._edges[node << _TOKEN_BITS | self._token[child]]
        prev, after = self._prev_sibling[child], self._next_sibling[child]
        if prev == _NONE:
            self._first_child[node] = after
        else:
            self._next_sibling[prev] = after
        if after != _NONE:
            self._prev_sibling[after] = prev
        self._free.append(child)
        self.num_nodes -= 1

    def _most_frequent_child(self, node: int) -> int:
        best, child = _NONE, self._first_child[node]
        while child != _NONE:
            if best == _NONE or self._count[child] > self._count[best]:
                best = child
            child = self._next_sibling[child]
        return best
