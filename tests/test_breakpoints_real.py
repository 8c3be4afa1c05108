"""Issue 31: breakpoints on real tokenizers and models. The encoding stage turns a row's marks
into positions in the state prefix's tokens (SmolLM2's and Qwen3.5's tokenizers); a hybrid model
(tiny Qwen3.5) then resumes a state that changed after the mark from the breakpoint, exactly,
where without the mark it is a miss."""

from __future__ import annotations

from dataclasses import replace

import pytest
from exactness import worst_difference
from rows_factory import make_rows
from test_breakpoints import HISTORY, QUESTIONS, log_input, marked_text

from semif_serve.apis.decisions import parse
from semif_serve.scoring import Row, parse_row, score_shared
from semif_serve.scoring.breakpoints import MAX_BREAKPOINTS, breakpoint_positions
from semif_serve.scoring.checkpoints import BREAKPOINT
from semif_serve.scoring.inputs import direct_input, shared_input
from semif_serve.scoring.prefix_cache import PrefixCache
from semif_serve.state_key import state_json


def marked_rows(body_input, count: int = 2) -> list[Row]:
    """Rows over a Decisions input's state, with its marks (as the route hands them over)."""
    request = parse({"input": body_input, "questions": QUESTIONS})
    rows = make_rows(count, [2, 3], state=request.state)
    return [replace(parse_row(row), breakpoints=request.breakpoints) for row in rows]


def rows_over(status: str, marked: bool = True) -> list[Row]:
    return marked_rows(log_input(status, marked))


@pytest.mark.parametrize("model_name", ["smollm2", "tiny_qwen"])
def test_a_mark_is_a_token_boundary_of_the_prefix_at_or_before_it(request, model_name):
    scoring_model = request.getfixturevalue(model_name)
    tokenizer = scoring_model.tokenizer
    rows = rows_over("open")
    encoded = shared_input(tokenizer, rows, 4096)
    (position,) = encoded.breakpoints
    prefix = encoded.prefix_ids
    assert 0 < position < len(prefix)
    text = encoded.prompts[0].text
    through = tokenizer.decode(prefix[:position])
    mark_end = text.index(state_json(HISTORY[-1])[1:-1]) + len(state_json(HISTORY[-1])[1:-1])
    assert text.startswith(through) and len(through) <= mark_end
    assert mark_end - len(through) <= 8  # close to the mark, not merely somewhere before it
    # The direct path locates the same position.
    assert direct_input(tokenizer, rows[0], 4096, with_prefix=True).breakpoints == (position,)


def test_only_the_last_marks_are_kept(smollm2):
    (row,) = marked_rows([{"role": "user", "content": [marked_text(e) for e in HISTORY]}], 1)
    assert len(row.breakpoints) == len(HISTORY) > MAX_BREAKPOINTS
    encoded = shared_input(smollm2.tokenizer, [row], 4096)
    assert len(encoded.breakpoints) == MAX_BREAKPOINTS
    last = breakpoint_positions(smollm2.tokenizer, row, encoded.prompts[0].text, encoded.prefix_ids)
    assert last == encoded.breakpoints


@pytest.mark.parametrize("marked", [True, False])
def test_a_hybrid_state_changed_after_its_mark_resumes_from_the_breakpoint_exactly(
    tiny_qwen, marked
):
    view = PrefixCache(1 << 30, min_tokens=16, checkpoint_tokens=0).for_model(("m", "t"))
    # The status changes well before the state's end (more than two 64-token delta-rule
    # chunks): before the chunk start where the stored prefill ends, and the boundary checkpoint.
    tail = "; the queue holds print jobs from accounting, sales and the front desk" * 12
    first = rows_over("waiting for the technician" + tail, marked)
    _, stored = score_shared(tiny_qwen, first, max_tokens=4096, prefix_cache=view)
    changed = rows_over("fixed, test page printed clean" + tail, marked)
    cold, _ = score_shared(tiny_qwen, changed, max_tokens=4096)
    cached, timing = score_shared(tiny_qwen, changed, max_tokens=4096, prefix_cache=view)
    assert worst_difference(cold, cached) == 0
    if marked:
        assert timing["reuse_point"] == BREAKPOINT and timing["cached_tokens"] >= 64
        assert timing["cached_tokens"] % 64 == 0  # the mark's chunk start
    else:  # the status changed before the boundary checkpoint: nothing to resume from
        assert stored["prefix_tokens"] > 200
        assert (timing["reuse_point"], timing["cached_tokens"]) == (None, 0)
