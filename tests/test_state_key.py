"""The state key: sha256 of the state exactly as the prompt embeds it, and the server's
X-Semif-State-Key reply header (docs/api.md#the-state-key)."""

import hashlib
import json
import subprocess
import sys

import pytest
from fakes import AUTH, decision, fake_app, row
from falcon import testing

from semif_serve.scoring.prompt import state_head, user_message
from semif_serve.scoring.rows import MAX_STATE_DEPTH
from semif_serve.state_key import STATE_KEY_HEADER, state_json, state_key

EVIDENCE = '{"evidence": '
STATES = [
    "Die Tür steht offen. 门开着。🚪",
    {"ticket": "Drucker im 3. Stock", "prio": 2, "tags": ["ü", None, 1.5, True]},
    ["Ana: «la puerta está abierta»", {"n": 10**30}],
]


def sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def embedded_state(scored_row) -> str:
    """The state's text inside the prompt the scorer was given."""
    head = state_head(scored_row)
    assert head.startswith(EVIDENCE) and user_message(scored_row).startswith(head)
    return head[len(EVIDENCE) :]


def post(client, path, body, headers=AUTH):
    raw = json.dumps(body, ensure_ascii=False).encode("utf-8")  # non-ASCII as UTF-8 bytes
    return client.simulate_post(
        path, body=raw, headers={**headers, "Content-Type": "application/json"}
    )


@pytest.mark.parametrize("state", STATES, ids=["string", "object", "array"])
def test_the_key_is_sha256_of_the_states_text_in_the_prompt(state):
    from semif_serve.scoring.rows import parse_row

    parsed = parse_row(row(state=state))
    assert embedded_state(parsed) == state_json(state)
    assert state_key(state) == sha256(state_json(state))
    assert len(state_key(state)) == 64 and set(state_key(state)) <= set("0123456789abcdef")


def test_keys_differ_with_key_order_and_number_type_like_the_prompt():
    assert state_key({"a": 1, "b": 2}) != state_key({"b": 2, "a": 1})
    assert state_key([1]) != state_key([1.0])
    assert state_key("x") != state_key(["x"])


def test_a_lone_surrogate_the_json_parser_accepts_still_has_a_key():
    state = json.loads('"\\ud800 half a pair"')
    assert (
        state_key(state)
        == hashlib.sha256(state_json(state).encode("utf-8", "surrogatepass")).hexdigest()
    )


def test_the_module_imports_no_torch():
    code = "import sys, semif_serve.state_key; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


@pytest.mark.parametrize("state", STATES, ids=["string", "object", "array"])
def test_decide_answers_with_the_key_of_the_state_it_scored(state):
    app, scorer = fake_app()
    response = post(testing.TestClient(app), "/decide", row(state=state))
    assert response.status_code == 200, response.json
    ((_, scored),) = scorer.calls
    assert response.headers[STATE_KEY_HEADER] == sha256(embedded_state(scored))
    assert response.headers[STATE_KEY_HEADER] == state_key(state)


@pytest.mark.parametrize("state", STATES, ids=["string", "object", "array"])
def test_decide_and_decide_shared_give_one_state_one_key(state):
    app, scorer = fake_app()
    client = testing.TestClient(app)
    direct = post(client, "/decide", row(state=state))
    shared = post(
        client,
        "/decide/shared",
        {"state": state, "decisions": [decision("a"), decision("b", orderings="rotations")]},
    )
    ascii_body = client.simulate_post("/decide", json=row(state=state), headers=AUTH)
    assert direct.status_code == shared.status_code == ascii_body.status_code == 200
    keys = {r.headers[STATE_KEY_HEADER] for r in (direct, shared, ascii_body)}
    assert keys == {state_key(state)}
    _, shared_rows = scorer.calls[1]
    assert {sha256(embedded_state(scored)) for scored in shared_rows} == keys


def test_a_key_the_client_sent_is_answered_with_the_true_one():
    app, _ = fake_app()
    wrong = {**AUTH, STATE_KEY_HEADER: "0" * 64}
    response = post(testing.TestClient(app), "/decide", row(state="s"), headers=wrong)
    assert response.status_code == 200
    assert response.headers[STATE_KEY_HEADER] == state_key("s")


DEEP: list = ["x"]
for _ in range(MAX_STATE_DEPTH):
    DEEP = [DEEP]


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/decide", row(state="  ")),
        ("/decide", row(state=5)),
        ("/decide", row(state=[])),
        ("/decide", row(state=DEEP)),
        ("/decide", {key: value for key, value in row().items() if key != "state"}),
        ("/decide/shared", {"state": {}, "decisions": [decision("a")]}),
        ("/decide/shared", {"decisions": [decision("a")]}),
    ],
    ids=["blank", "number", "empty-array", "too-deep", "missing", "shared-empty", "shared-missing"],
)
def test_a_state_the_server_refuses_gets_a_422_without_a_key(path, body):
    app, _ = fake_app()
    response = testing.TestClient(app).simulate_post(path, json=body, headers=AUTH)
    assert response.status_code == 422
    assert response.json["error"]["message"].startswith("state")
    assert STATE_KEY_HEADER not in response.headers
    assert "X-Request-Id" in response.headers


def test_a_body_that_is_not_json_gets_a_422_without_a_key():
    app, _ = fake_app()
    response = testing.TestClient(app).simulate_post(
        "/decide", body=b'{"state": NaN}', headers=AUTH
    )
    assert response.status_code == 422
    assert STATE_KEY_HEADER not in response.headers


def test_an_error_after_the_state_was_accepted_still_carries_its_key():
    app, _ = fake_app()
    body = row(state={"door": "open"}, options=("only one",))
    response = testing.TestClient(app).simulate_post("/decide", json=body, headers=AUTH)
    assert response.status_code == 422
    assert response.json["error"]["message"].startswith("options")
    assert response.headers[STATE_KEY_HEADER] == state_key({"door": "open"})


def test_requests_refused_before_the_body_is_read_carry_no_key():
    app, _ = fake_app(max_body_bytes=100)
    client = testing.TestClient(app)
    unauthorized = client.simulate_post("/decide", json=row())
    too_large = client.simulate_post("/decide", json=row(state="x" * 200), headers=AUTH)
    health = client.simulate_get("/health")
    assert (unauthorized.status_code, too_large.status_code, health.status_code) == (401, 413, 200)
    for response in (unauthorized, too_large, health):
        assert STATE_KEY_HEADER not in response.headers
