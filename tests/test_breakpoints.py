"""Issue 31: an OpenAI Decisions caller's `prompt_cache_breakpoint` marks become checkpoints.

The API layer records where each marked input text ends in the state as the prompt shows it,
and the route hands those ends to every row (fake scorer, falcon's client; fast enough for the
mutation grids). On real tokenizers and models: tests/test_breakpoints_real.py."""

from __future__ import annotations

from fakes import AUTH, FakeScorer, fake_app
from falcon import testing

from semif_serve.apis.decisions import marked_ends, parse
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


def test_marks_in_mixed_parts_and_tool_outputs_end_where_their_texts_do():
    body = {
        "input": [
            {
                "role": "user",
                "content": [{"type": "input_json", "data": {"k": "v"}}, marked_text("a")],
            },
            {"type": "function_call", "call_id": "c1", "name": "look", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": [marked_text("seen")]},
            {"type": "function_call_output", "call_id": "c1", "output": "plain"},
        ],
        "questions": QUESTIONS,
    }
    request = parse(body)
    shown = state_json(request.state)
    assert [shown[:end][-4:] for end in request.breakpoints] == [', "a', "seen"]
    assert (
        request.state[0]["content"][0] == {"input_json": {"k": "v"}}
        and type(request.state[2]["output"]) is str
    )
    assert request.state[3]["output"] == "plain"
