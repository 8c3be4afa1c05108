"""A radix tree over stored token sequences: which stored sequences share the longest start with
a new one, and how long that start is, in O(its length).

Each edge holds a run of token ids; a node knows the keys of the sequences that end on it
(`ending`) and of every sequence that passes through it (`through`). `matches` walks one path,
as far as the new ids go along the tree: the sequences that end on it are starts of the new
ids (their whole length is shared), and where it stops, every sequence through that point
shares exactly what was matched, the longest start any stored sequence shares.
Sequences that share fewer than `at_least` tokens are never listed, so an unrelated state costs
one short walk.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence


class _Node:
    __slots__ = ("edge", "children", "ending", "through")

    def __init__(self, edge: tuple[int, ...] = ()):
        self.edge = edge  # the ids from the parent to this node
        self.children: dict[int, _Node] = {}  # by the first id of the child's edge
        self.ending: set[Hashable] = set()
        self.through: set[Hashable] = set()


class PrefixTree:
    def __init__(self) -> None:
        self._root = _Node()

    def __len__(self) -> int:
        return len(self._root.through)

    def add(self, key: Hashable, ids: Sequence[int]) -> None:
        """Store `ids` under `key` (a key is stored once; the caller keeps keys unique)."""
        node, at = self._root, 0
        node.through.add(key)
        while at < len(ids):
            child = node.children.get(ids[at])
            if child is None:
                child = node.children[ids[at]] = _Node(tuple(ids[at:]))
            shared = _shared(child.edge, ids, at)
            if shared < len(child.edge):
                child = _split(node, child, shared)
            child.through.add(key)
            node, at = child, at + shared
        node.ending.add(key)

    def remove(self, key: Hashable, ids: Sequence[int]) -> None:
        """Forget `key`, stored with these `ids`; nodes nobody passes through any more go."""
        node, at = self._root, 0
        node.through.discard(key)
        while at < len(ids):
            child = node.children.get(ids[at])
            if child is None:  # not stored: nothing below to forget
                return
            child.through.discard(key)
            if not child.through:
                del node.children[ids[at]]
                return
            node, at = child, at + len(child.edge)
        node.ending.discard(key)

    def matches(self, ids: Sequence[int], at_least: int = 1) -> list[tuple[Hashable, int]]:
        """(key, shared tokens) of the stored sequences that share the longest start with `ids`,
        and of those that are a start of `ids` themselves, when they share at least `at_least`
        tokens. (Others share less than the longest; the walk does not visit them.)"""
        found: list[tuple[Hashable, int]] = []
        node, at = self._root, 0
        while True:
            if at >= at_least:
                found += [(key, at) for key in node.ending]
            child = node.children.get(ids[at]) if at < len(ids) else None
            if child is None:  # every sequence through here shares `at`, and none more
                below = node.through - node.ending
                break
            shared = _shared(child.edge, ids, at)
            if shared < len(child.edge):  # those below `child` share `at + shared`
                at, below = at + shared, child.through
                break
            node, at = child, at + shared
        if at >= at_least:
            found += [(key, at) for key in below]
        return found


def _shared(edge: tuple[int, ...], ids: Sequence[int], at: int) -> int:
    """How many ids of `edge` equal those of `ids` from `at` on."""
    count, most = 0, min(len(edge), len(ids) - at)
    while count < most and edge[count] == ids[at + count]:
        count += 1
    return count


def _split(parent: _Node, child: _Node, shared: int) -> _Node:
    """Put a node after the edge's first `shared` ids, between `parent` and `child`."""
    middle = _Node(child.edge[:shared])
    middle.through = set(child.through)
    child.edge = child.edge[shared:]
    middle.children[child.edge[0]] = child
    parent.children[middle.edge[0]] = middle
    return middle
