"""A depth-bounded suffix tree with counts (suffix decoding's structure).

Every window ``tokens[i : i + d]`` (``d <= max_depth``) of the sequences added
is a path from the root; a node's ``count`` is how many times its path occurs.
That is a suffix trie cut at ``max_depth``: enough to match the last
``max_depth - 1`` tokens of a context and follow the most frequent
continuation. A sequence grows one token at a time through a `Cursor` (the
nodes of its last ``max_depth - 1`` suffixes), so appending a token costs
``O(max_depth)`` and nothing is ever rebuilt; removing a sequence walks its
windows once and drops the nodes no other sequence uses.
"""

from __future__ import annotations

from collections.abc import Sequence


class Node:
    __slots__ = ("children", "count")

    def __init__(self) -> None:
        self.count = 0
        self.children: dict[int, Node] = {}


# The nodes of a sequence's suffixes that may still grow: cursor[m - 1] is the
# node of its last m tokens, for m < max_depth (longest last).
Cursor = list[Node]


class SuffixTree:
    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.root = Node()
        self.num_nodes = 1

    def extend(self, cursor: Cursor, tokens: Sequence[int]) -> None:
        """Append `tokens` to the sequence whose suffixes `cursor` holds."""
        keep = self.max_depth - 1
        root = self.root
        for token in tokens:
            root.count += 1
            grown = []
            for node in (root, *cursor):  # every suffix grows by `token`, up to depth max_depth
                child = node.children.get(token)
                if child is None:
                    child = node.children[token] = Node()
                    self.num_nodes += 1
                child.count += 1
                grown.append(child)
            cursor[:] = grown[:keep]

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `extend` of these tokens (a whole sequence, as added)."""
        for start in range(len(tokens)):
            self.root.count -= 1
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    self.num_nodes -= _size(child)
                    del node.children[token]
                    break
                node = child

    def longest_match(self, context: Sequence[int]) -> tuple[Node, int]:
        """(node, m): the longest suffix of `context` (m < max_depth tokens)
        that occurs followed by something, and its node (the root, m = 0,
        when none). Such suffixes are closed under shortening, so binary search."""
        low, high = 0, min(len(context), self.max_depth - 1)
        best = self.root
        while low < high:
            mid = (low + high + 1) // 2
            node = self.find(context[len(context) - mid :])
            if node is not None and node.children:
                low, best = mid, node
            else:
                high = mid - 1
        return best, low

    def find(self, path: Sequence[int]) -> Node | None:
        """The node of `path` (None: it never occurred)."""
        node = self.root
        for token in path:
            child = node.children.get(token)
            if child is None:
                return None
            node = child
        return node


def _size(node: Node) -> int:
    """Nodes in the subtree under (and including) `node`."""
    stack, size = [node], 0
    while stack:
        size += 1
        stack.extend(stack.pop().children.values())
    return size


def cursor_match(cursor: Cursor) -> tuple[Node | None, int]:
    """`longest_match` for the sequence the cursor belongs to: its longest
    suffix that occurred earlier with a continuation (None, 0 when none)."""
    for m in range(len(cursor), 0, -1):
        if cursor[m - 1].children:
            return cursor[m - 1], m
    return None, 0


def greedy_draft(node: Node, max_tokens: int, min_token_prob: float) -> tuple[list[int], float]:
    """(tokens, score): from `node`, follow the most frequent child while the
    path's estimated probability (the product of child count / parent count)
    stays >= min_token_prob; score is the sum of those probabilities."""
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < max_tokens and node.children:
        token, child = max(node.children.items(), key=lambda item: item[1].count)
        prob *= child.count / node.count
        if prob < min_token_prob:
            break
        tokens.append(token)
        score += prob
        node = child
    return tokens, score
