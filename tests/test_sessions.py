"""Issue 31: a caller's session (X-Semif-Session on any scoring route, prompt_cache_key on
/v1/decisions) reaches the scorer as each row's `cache_key`, the partition its stored state
prefixes live in; a bad one is a 422 naming where it came from. Fake scorer, falcon's client."""

from __future__ import annotations

import pytest
from fakes import AUTH, FakeScorer, decision, fake_app, row
from falcon import testing

from semif_serve.errors import InvalidRequest
from semif_serve.session import MAX_SESSION_LENGTH, SESSION_HEADER, parse_session

DECISIONS = {
    "input": "The door is open.",
    "questions": [{"type": "predicate", "instructions": "Open?"}],
}
SYSTEM_ONE = {
    "state": {"door": "open"},
    "questions": {"a": {"type": "noul", "instructions": "Open?"}},
}


def post(path, body, session=None):
    app, scorer = fake_app(FakeScorer())
    headers = AUTH if session is None else {**AUTH, SESSION_HEADER: session}
    return testing.TestClient(app).simulate_post(path, json=body, headers=headers), scorer


def sessions(scorer):
    """Each row's session, over every call the scorer was sent."""
    rows = [r for _, sent in scorer.calls for r in (sent if isinstance(sent, list) else [sent])]
    return [r.cache_key for r in rows]


@pytest.mark.parametrize(
    ("path", "body", "rows"),
    [
        ("/decide", row(), 1),
        ("/decide", {**row(), "orderings": "rotations"}, 2),  # each ordering's row
        ("/decide/shared", {"state": "s", "decisions": [decision("a"), decision("b")]}, 2),
        ("/v1/systemone", SYSTEM_ONE, 1),
        ("/v1/decisions", DECISIONS, 1),
    ],
)
def test_the_session_header_reaches_every_row_and_none_means_none(path, body, rows):
    response, scorer = post(path, body, session="agent-7/run:3")
    assert response.status_code == 200, response.text
    assert sessions(scorer) == ["agent-7/run:3"] * rows
    response, scorer = post(path, body)
    assert response.status_code == 200, response.text
    assert sessions(scorer) == [None] * rows


def test_prompt_cache_key_is_the_decisions_session_and_wins_over_the_header():
    keyed = {**DECISIONS, "prompt_cache_key": "tenant 1 / ünïcode"}  # any text in the body
    assert sessions(post("/v1/decisions", keyed)[1]) == ["tenant 1 / ünïcode"]
    assert sessions(post("/v1/decisions", keyed, session="header")[1]) == ["tenant 1 / ünïcode"]
    unkeyed = {**DECISIONS, "prompt_cache_key": None}
    assert sessions(post("/v1/decisions", unkeyed, session="header")[1]) == ["header"]


@pytest.mark.parametrize(
    ("session", "message"),
    [
        ("x" * (MAX_SESSION_LENGTH + 1), f"must be 1 to {MAX_SESSION_LENGTH} characters, got 1025"),
        ("two words", "only visible ASCII characters (33-126) are allowed"),
        ("caf\u00e9", "only visible ASCII characters (33-126) are allowed"),
    ],
)
def test_a_bad_session_header_is_a_422_naming_it_and_nothing_is_scored(session, message):
    for path, body in [("/decide", row()), ("/v1/decisions", DECISIONS)]:
        response, scorer = post(path, body, session=session)
        assert response.status_code == 422, response.text
        assert response.json["error"]["message"] == f"{SESSION_HEADER}: {message}"
        assert scorer.calls == []


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (5, "prompt_cache_key: must be a string"),
        ("", f"prompt_cache_key: must be 1 to {MAX_SESSION_LENGTH} characters, got 0"),
        ("k" * 1025, f"prompt_cache_key: must be 1 to {MAX_SESSION_LENGTH} characters, got 1025"),
    ],
)
def test_a_bad_prompt_cache_key_is_a_422_naming_it(key, message):
    response, scorer = post("/v1/decisions", {**DECISIONS, "prompt_cache_key": key})
    assert response.status_code == 422, response.text
    assert response.json["error"]["message"] == message
    assert response.json["error"]["param"] == "prompt_cache_key"
    assert scorer.calls == []


def test_parse_session_bounds():
    assert parse_session(None) is None
    assert parse_session("!") == "!" and parse_session("~" * MAX_SESSION_LENGTH)
    for bad in ["", " ", "\x7f", "a\tb", 7]:
        with pytest.raises(InvalidRequest, match=f"^{SESSION_HEADER}: "):
            parse_session(bad)
    assert (
        parse_session(" x ", "prompt_cache_key", header=False) == " x "
    )  # a body key may be any text
