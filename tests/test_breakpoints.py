"""Issue 31: an OpenAI Decisions caller's `prompt_cache_breakpoint` marks become checkpoints.

The API layer records where each marked input text ends in the state as the prompt shows it;
the route hands those ends to every row; the encoding stage turns them into positions in the
state prefix's tokens (real tokenizers); a hybrid model (tiny Qwen3.5) then resumes a state that
changed after the mark from the breakpoint, exactly, where without the mark it is a miss."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import AUTH, FakeScorer, fake_app
from falcon import testing
from rows_factory import make_rows

from semif_serve.apis.decisions import marked_ends, parse
from semif_serve.scoring import Row, parse_row, score_shared
from semif_serve.scoring.breakpoints import MAX_BREAKPOINTS, breakpoint_positions
from semif_serve.scoring.checkpoints import BREAKPOINT
from semif_serve.scoring.inputs import direct_input, shared_input
from semif_serve.scoring.prefix_cache import PrefixCache
from semif_serve.state_key import state_json

MARK = {"mode": "explicit"}
QUESTIONS = [{"type": "predicate", "instructions": "Is the printer fixed?"}]
HISTORY = [
    "user opened ticket about the printer on floor 3",
    'agent asked for the "error code" shown on the panel',
    "user replied: E-42 after every job, since Monday — ünïcode\nand a new line",
    "agent scheduled a technician visit for Thursday",
    "technician replaced the fuser unit and ran a test page",
]


def marked_text(text: str) -> dict:
    return {"type": "input_text", "text": text, "prompt_cache_breakpoint": MARK}


def log_input(status: str, marked: bool = True) -> list[dict]:
    """An agent's input: its history (the last event marked) and a status line that changes."""
    history = [{"role": "user", "content": event} for event in HISTORY[:-1]]
    last = marked_text(HISTORY[-1]) if marked else {"type": "input_text", "text": HISTORY[-1]}
    return [
        *history,
        {"role": "user", "content": [last]},
        {"role": "developer", "content": f"current status: {status}"},
    ]


def test_each_marked_text_ends_where_its_mark_says_in_the_prompted_state():
    body = {
        "input": [
            {"role": "user", "content": [marked_text(HISTORY[1]), marked_text(HISTORY[2])]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "noted"}]},
            {"role": "user", "content": [marked_text(HISTORY[4])]},
        ],
        "questions": QUESTIONS,
    }
    request = parse(body)
    shown = state_json(request.state)
    assert len(request.breakpoints) == 3
    for end, text in zip(request.breakpoints, [HISTORY[1], HISTORY[2], HISTORY[4]]):
        assert shown[:end].endswith(state_json(text)[1:-1])  # the text as JSON escapes it
        assert shown[end] == '"'
    # The state is plain JSON: no marked string reaches the rows.
    assert type(request.state[0]["content"][0]) is str
    assert type(request.state[2]["content"]) is str


def test_no_mark_no_ends_and_a_mark_in_instructions_marks_no_state():
    assert (
        parse({"input": log_input("open", marked=False), "questions": QUESTIONS}).breakpoints == ()
    )
    assert parse({"input": "plain text state", "questions": QUESTIONS}).breakpoints == ()
    marked_question = [{"type": "predicate", "instructions": [marked_text("Fixed?")]}]
    assert parse({"input": "a state", "questions": marked_question}).breakpoints == ()
    assert marked_ends({"not": "a list"}) == ({"not": "a list"}, ())


def test_a_bad_breakpoint_is_a_422_naming_the_part():
    app, scorer = fake_app(FakeScorer())
    bad = {"type": "input_text", "text": "x", "prompt_cache_breakpoint": {"mode": "auto"}}
    body = {"input": [{"role": "user", "content": [bad]}], "questions": QUESTIONS}
    response = testing.TestClient(app).simulate_post("/v1/decisions", json=body, headers=AUTH)
    assert response.status_code == 422, response.text
    assert response.json["error"]["message"] == (
        'input[0].content[0].prompt_cache_breakpoint: must be {"mode": "explicit"}'
    )
    assert scorer.calls == []


def test_the_decisions_route_hands_the_ends_to_every_row():
    app, scorer = fake_app(FakeScorer())
    body = {"input": log_input("open"), "questions": QUESTIONS * 2}
    response = testing.TestClient(app).simulate_post("/v1/decisions", json=body, headers=AUTH)
    assert response.status_code == 200, response.text
    rows = [r for _, sent in scorer.calls for r in (sent if isinstance(sent, list) else [sent])]
    expected = parse(body).breakpoints
    assert len(expected) == 1 and [r.breakpoints for r in rows] == [expected, expected]


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


def worst(expected: list[dict], results: list[dict]) -> float:
    return max(
        abs(a - b)
        for one, other in zip(expected, results, strict=True)
        for a, b in zip(one["probabilities"], other["probabilities"])
    )


@pytest.mark.parametrize("marked", [True, False])
def test_a_hybrid_state_changed_after_its_mark_resumes_from_the_breakpoint_exactly(
    tiny_qwen, marked
):
    view = PrefixCache(1 << 30, min_tokens=16, checkpoint_tokens=0).for_model(("m", "t"))
    first = rows_over("waiting for the technician", marked)
    score_shared(tiny_qwen, first, max_tokens=4096, prefix_cache=view)
    changed = rows_over("fixed, test page printed clean", marked)
    cold, _ = score_shared(tiny_qwen, changed, max_tokens=4096)
    cached, timing = score_shared(tiny_qwen, changed, max_tokens=4096, prefix_cache=view)
    assert worst(cold, cached) <= 1e-5
    if marked:
        assert timing["reuse_point"] == BREAKPOINT and timing["cached_tokens"] > 100
    else:  # the status changed before the boundary checkpoint: nothing to resume from
        assert (timing["reuse_point"], timing["cached_tokens"]) == (None, 0)
