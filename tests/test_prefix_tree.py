"""The radix tree behind the longest-prefix lookup: what `matches` lists (the sequences sharing the
longest start, and those that are starts of the new ids) equals what a scan of every stored
sequence finds (hypothesis, over adds and removes of sequences over a tiny alphabet, so that
they share starts often), and the cases by hand: splits, a sequence ending inside an edge or
on a node, removal pruning, `at_least`."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from semif_serve.scoring.prefix_tree import PrefixTree

sequences = st.lists(st.integers(0, 2), min_size=0, max_size=8)


def common(left, right) -> int:
    count = 0
    for a, b in zip(left, right):
        if a != b:
            break
        count += 1
    return count


def scan(stored: dict, ids, at_least: int) -> dict:
    """What `matches` must find, by a scan of every stored sequence: {key: shared tokens} of
    those sharing the longest start, and of those that are starts of `ids`."""
    shared = {key: common(seq, ids) for key, seq in stored.items()}
    longest = max(shared.values(), default=0)
    return {
        key: n
        for key, n in shared.items()
        if n >= at_least and (n == longest or n == len(stored[key]))
    }


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.booleans(), sequences), max_size=12),
    sequences,
    st.integers(0, 4),
)
def test_matches_equal_a_scan_of_every_stored_sequence(operations, ids, at_least):
    tree, stored = PrefixTree(), {}
    for number, (adding, seq) in enumerate(operations):
        if adding or not stored:
            tree.add(number, seq)
            stored[number] = seq
        else:
            key = sorted(stored)[number % len(stored)]
            tree.remove(key, stored.pop(key))
    assert len(tree) == len(stored)
    found = tree.matches(ids, at_least)
    assert len(found) == len(set(key for key, _ in found))  # each key once
    assert dict(found) == scan(stored, ids, at_least)


def test_a_sequence_ending_inside_an_edge_shares_all_of_the_new_ids():
    tree = PrefixTree()
    tree.add("long", [1, 2, 3, 4, 5])
    assert tree.matches([1, 2, 3]) == [("long", 3)]
    assert tree.matches([1, 2, 9]) == [("long", 2)]
    assert tree.matches([9]) == []


def test_a_stored_start_of_the_new_ids_shares_its_whole_length():
    tree = PrefixTree()
    tree.add("short", [1, 2])
    tree.add("long", [1, 2, 3, 4])
    assert sorted(tree.matches([1, 2, 3, 4, 5])) == [("long", 4), ("short", 2)]
    assert sorted(tree.matches([1, 2, 7])) == [("long", 2), ("short", 2)]
    assert sorted(tree.matches([1, 2])) == [("long", 2), ("short", 2)]


def test_at_least_leaves_out_short_shared_starts():
    tree = PrefixTree()
    tree.add("a", [1, 2, 3])
    tree.add("b", [1, 5])
    assert sorted(tree.matches([1, 2, 3], at_least=2)) == [("a", 3)]
    assert tree.matches([1, 2, 3], at_least=4) == []
    assert tree.matches([1, 2], at_least=1) == [("a", 2)]  # b shares less than the longest
    assert tree.matches([1, 5, 6], at_least=1) == [("b", 2)]
    assert sorted(tree.matches([1, 9])) == [("a", 1), ("b", 1)]  # by default one token is enough


def test_removing_a_sequence_forgets_it_and_keeps_the_others():
    tree = PrefixTree()
    tree.add("a", [1, 2, 3])
    tree.add("b", [1, 2, 4])
    tree.add("c", [1, 2])
    tree.remove("a", [1, 2, 3])
    assert sorted(tree.matches([1, 2, 3])) == [("b", 2), ("c", 2)]
    tree.remove("c", [1, 2])
    assert tree.matches([1, 2, 3]) == [("b", 2)]
    tree.remove("b", [1, 2, 4])
    assert tree.matches([1, 2, 4]) == [] and len(tree) == 0
    assert tree._root.children == {}  # nothing left behind


def test_removing_an_unknown_sequence_changes_nothing():
    tree = PrefixTree()
    tree.add("a", [1, 2, 3])
    tree.remove("x", [7, 8])
    tree.remove("x", [1, 2, 3])
    assert tree.matches([1, 2, 3]) == [("a", 3)] and len(tree) == 1


def test_an_empty_sequence_is_stored_at_the_root():
    tree = PrefixTree()
    tree.add("empty", [])
    assert tree.matches([1, 2], at_least=0) == [("empty", 0)]
    assert tree.matches([1, 2]) == []
