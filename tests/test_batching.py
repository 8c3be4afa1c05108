"""Issue 23: the dynamic batcher's selection (a pure function, fast enough for its mutation
grid): arrival order, the row and padded-token limits, the oldest request always first and
never blocking the queue, no request overtaken by a younger one."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from semif_serve.runtime.selection import Cost, padded_tokens, select


def costs(*pairs: tuple[int, int]) -> list[Cost]:
    return [Cost(rows, length) for rows, length in pairs]


def test_padded_tokens_are_rows_times_the_longest_prompt():
    assert padded_tokens([]) == 0
    assert padded_tokens(costs((1, 100))) == 100
    assert padded_tokens(costs((1, 100), (3, 40), (2, 250))) == 6 * 250


@pytest.mark.parametrize(
    ("queue", "max_rows", "max_tokens", "taken"),
    [
        ([], 8, 1000, 0),
        ([(1, 100)], 8, 1000, 1),
        ([(1, 100)] * 10, 8, 10_000, 8),  # the row limit
        ([(1, 100)] * 10, 16, 1_000, 10),  # 10 x 100 = 1000: exactly the budget
        ([(1, 100)] * 11, 16, 1_000, 10),
        ([(1, 100), (1, 600)], 8, 1_000, 1),  # 2 x 600 > 1000: the second waits
        ([(1, 600), (1, 100)], 8, 1_200, 2),  # 2 x 600 = 1200
        ([(5, 100), (4, 100)], 8, 10_000, 1),  # a shared call is one unit: 9 rows > 8
        ([(5, 100), (3, 100)], 8, 10_000, 2),
        ([(20, 100), (1, 10)], 8, 1_000, 1),  # over both limits alone: it runs alone
        ([(1, 5_000), (1, 10)], 8, 1_000, 1),
        ([(1, 100), (1, 5_000), (1, 100)], 8, 1_000, 1),  # never skips to a younger one
        ([(1, 100), (1, 100), (1, 300)], 8, 900, 3),  # 3 x 300 = 900
        ([(1, 100), (1, 100), (1, 301)], 8, 900, 2),
    ],
)
def test_select_takes_the_oldest_within_the_limits(queue, max_rows, max_tokens, taken):
    assert select(costs(*queue), max_rows, max_tokens) == taken


pairs = st.tuples(st.integers(1, 20), st.integers(1, 3000))


@given(
    queue=st.lists(pairs, max_size=30), max_rows=st.integers(1, 64), budget=st.integers(1, 50_000)
)
def test_a_batch_is_a_prefix_of_the_queue_within_the_limits_unless_the_oldest_alone(
    queue, max_rows, budget
):
    queued = costs(*queue)
    taken = select(queued, max_rows, budget)
    if not queued:
        assert taken == 0
        return
    assert 1 <= taken <= len(queued)
    batch = queued[:taken]
    if taken > 1:  # a batch of several keeps both limits
        assert sum(cost.rows for cost in batch) <= max_rows
        assert padded_tokens(batch) <= budget
    if taken < len(queued):  # the next one would break a limit
        grown = queued[: taken + 1]
        assert sum(c.rows for c in grown) > max_rows or padded_tokens(grown) > budget
