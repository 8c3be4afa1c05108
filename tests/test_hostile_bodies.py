"""Absurd values a caller controls, through the app (issue 13, findings 1 and 2): each one is a
422 naming its field, and none leaves anything in the model's queue."""

import json

import pytest
from fakes import AUTH, WAIT_S, FakeScorer, fake_app, row
from falcon import testing
from live_server import fake_server

from semif_serve.runtime.service import MAX_TIMEOUT_S
from semif_serve.scoring.rows import MAX_STATE_DEPTH, InvalidRow, parse_row


def api_with(scorer=None, **overrides):
    app, scorer = fake_app(scorer, **overrides)
    return testing.TestClient(app), scorer


def error(response):
    return response.status_code, response.json["error"]["code"], response.json["error"]["message"]


def queued(api):
    (model,) = api.simulate_get("/v1/models", headers=AUTH).json["models"]
    return model["queued_requests"], model["active_slots"]


def nested(depth: int, leaf=1):
    """`depth` arrays around `leaf`: nested(0) is the leaf itself."""
    return json.loads("[" * depth + json.dumps(leaf) + "]" * depth)


HUGE_INTEGER = int("9" * 400)


@pytest.mark.parametrize(
    "value", [HUGE_INTEGER, -HUGE_INTEGER, 1e300, MAX_TIMEOUT_S + 0.5, 0, -1, 0.0, "5", True, None]
)
def test_timeout_s_out_of_bounds_is_a_422_naming_it(value):
    api, scorer = api_with()
    body = row(timeout_s=value) if value is not None else {**row(), "timeout_s": None}
    response = api.simulate_post("/decide", json=body, headers=AUTH)
    if value is None:  # null means "not given"
        assert response.status_code == 200
        return
    status, code, message = error(response)
    assert (status, code) == (422, "invalid_request")
    assert message.startswith("timeout_s:") and str(MAX_TIMEOUT_S) in message
    assert scorer.calls == []


@pytest.mark.parametrize("value", [1e-9, 1, 2.5, MAX_TIMEOUT_S])
def test_timeout_s_within_bounds_is_accepted(value):
    api, scorer = api_with()
    assert api.simulate_post("/decide", json=row(timeout_s=value), headers=AUTH).status_code == 200
    assert len(scorer.calls) == 1


def test_a_huge_timeout_while_the_model_is_busy_leaves_the_queue_empty():
    """Finding 1: a 400-digit timeout_s behind a busy model used to stay queued forever."""
    import threading

    scorer = FakeScorer(block=True)
    api, _ = api_with(scorer)
    first: list = []
    holder = threading.Thread(
        target=lambda: first.append(api.simulate_post("/decide", json=row(), headers=AUTH))
    )
    holder.start()
    assert scorer.entered.wait(WAIT_S)
    for body in (row(timeout_s=HUGE_INTEGER), {**row(), "timeout_s": 1e300}):
        response = api.simulate_post("/decide", json=body, headers=AUTH)
        assert response.status_code == 422
        assert queued(api) == (0, 1)  # only the holder, which is scoring
    shared = {"state": "s", "decisions": [{k: v for k, v in row().items() if k != "state"}]}
    response = api.simulate_post(
        "/decide/shared", json={**shared, "timeout_s": HUGE_INTEGER}, headers=AUTH
    )
    assert response.status_code == 422
    scorer.release.set()
    holder.join(WAIT_S)
    assert first[0].status_code == 200
    assert queued(api) == (0, 0)
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200


def test_a_state_at_the_depth_limit_is_scored_and_one_deeper_is_a_422():
    api, scorer = api_with()
    ok = api.simulate_post("/decide", json=row(state=nested(MAX_STATE_DEPTH)), headers=AUTH)
    assert ok.status_code == 200
    too_deep = api.simulate_post(
        "/decide", json=row(state=nested(MAX_STATE_DEPTH + 1)), headers=AUTH
    )
    status, code, message = error(too_deep)
    assert (status, code) == (422, "invalid_request")
    assert message.startswith(f"state: nested deeper than {MAX_STATE_DEPTH} levels")
    assert len(scorer.calls) == 1


def test_objects_count_toward_the_state_depth_like_arrays():
    state = {"a": 1}
    for _ in range(MAX_STATE_DEPTH - 1):
        state = {"a": state}
    parse_row({**row(), "state": state})
    with pytest.raises(InvalidRow, match="nested deeper"):
        parse_row({**row(), "state": {"a": state}})


def test_a_string_state_and_scalars_inside_have_no_depth_of_their_own():
    parse_row({**row(), "state": "x" * 10})
    parse_row({**row(), "state": nested(MAX_STATE_DEPTH, leaf="[[[[[[")})


@pytest.mark.parametrize("depth", [990, 5000, 100_000])
def test_bodies_nested_thousands_deep_are_a_422_not_a_500(depth):
    """Finding 2: ~990 levels used to be a 500 scoring_failed (RecursionError)."""
    api, scorer = api_with()
    body = json.dumps(row())[:-1] + ', "state": ' + "[" * depth + "1" + "]" * depth + "}"
    # The later "state" key replaces the first one: the deep value is what gets checked.
    response = api.simulate_post(
        "/decide", body=body, headers={**AUTH, "Content-Type": "application/json"}
    )
    status, code, message = error(response)
    assert (status, code) == (422, "invalid_request")
    assert message in ("body: JSON nested too deeply",) or message.startswith("state: nested")
    decisions = json.dumps([{k: v for k, v in row().items() if k != "state"}])
    deep = '{"a": ' * depth + "1" + "}" * depth
    deep_shared = '{"state": ' + deep + ', "decisions": ' + decisions + "}"
    response = api.simulate_post(
        "/decide/shared", body=deep_shared, headers={**AUTH, "Content-Type": "application/json"}
    )
    assert response.status_code == 422
    assert scorer.calls == []


def test_a_deep_state_is_reported_with_the_path_where_it_went_too_deep():
    state = {"ok": 1, "deep": nested(MAX_STATE_DEPTH)}
    with pytest.raises(InvalidRow, match=r"at state\.deep(\[0\]){31}\)"):
        parse_row({**row(), "state": state})


def test_the_first_invalid_value_in_document_order_is_the_one_reported():
    state = {"a": [1, float("nan")], "b": float("inf")}
    with pytest.raises(InvalidRow, match=r"^state\.a\[1\]: numbers must be finite"):
        parse_row({**row(), "state": state})


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_an_unsupported_method_on_a_public_route_is_a_405_without_a_token(path):
    api, _ = api_with()
    response = api.simulate_request("TRACE", path)
    assert (response.status_code, response.json["error"]["code"]) == (405, "method_not_allowed")
    assert "GET" in response.headers["allow"]
    assert api.simulate_post("/decide", json=row()).status_code == 401  # the rest still needs one


# --- lone surrogates (issue 21, finding 5) ---------------------------------------------------
# json.dumps writes a lone surrogate as its escape ("\ud800"), as a hostile client would send it.
# Before, an id was scored and then the reply failed to encode (a bodyless 500 logged as 200);
# a state, question or description was a 500 from the tokenizer.

LONE = "contains a lone surrogate (\\ud800), which is not valid Unicode text"
SHARED = {"state": "s", "decisions": [{k: v for k, v in row(id="d0").items() if k != "state"}]}


def send_escaped(api, method, path, body, headers):
    """`body` as json.dumps writes it by default: ASCII, a surrogate as its \\u escape."""
    headers = {**headers, "Content-Type": "application/json"}
    return api.simulate_request(method, path, body=json.dumps(body), headers=headers)


def with_options(**option):
    body = row()
    body["options"][1].update(option)
    return body


def with_shared_decision_id(value):
    body = json.loads(json.dumps(SHARED))
    body["decisions"].append({**body["decisions"][0], "id": value})
    return body


@pytest.mark.parametrize(
    ("path", "body", "named"),
    [
        ("/decide", row(id="\ud800"), "id:"),
        ("/decide", row(state={"door": ["open", "x\ud800"]}), "state.door[1]:"),
        ("/decide", row(state={"door": {"k\ud800": 1}}), 'state.door: the key "k\\ud800"'),
        ("/decide", row(state="\ud800"), "state:"),
        ("/decide", row(question="Is it \ud800?"), "question:"),
        ("/decide", with_options(id="\ud800"), "options[1].id:"),
        ("/decide", with_options(description="\ud800 No"), "options[1].description:"),
        ("/decide/shared", with_shared_decision_id("\ud800"), "decisions[1].id:"),
        ("/decide/shared", {**SHARED, "state": ["\ud800"]}, "state[0]:"),
    ],
)
def test_a_lone_surrogate_is_a_422_naming_its_field_and_is_never_scored(path, body, named):
    api, scorer = api_with()
    response = send_escaped(api, "POST", path, body, AUTH)
    assert error(response) == (422, "invalid_request", f"{named} {LONE}")
    assert "x-semif-state-key" not in response.headers
    assert scorer.calls == []
    assert queued(api) == (0, 0)


def test_a_lone_surrogate_in_a_model_table_is_a_422_and_registers_nothing():
    admin = "a" * 40
    api, _ = api_with(admin_token=admin)
    admin_auth = {"Authorization": f"Bearer {admin}"}
    response = send_escaped(api, "PUT", "/v1/models/c", {"source": "test:\ud800"}, admin_auth)
    assert error(response) == (422, "invalid_request", f"source: {LONE}")
    assert [
        model["id"] for model in api.simulate_get("/v1/models", headers=AUTH).json["models"]
    ] == ["default"]


def test_a_surrogate_pair_is_one_valid_character_and_is_scored():
    api, scorer = api_with()
    body = row(id="\U0001f600", state={"\U0001f600": "\U0001f600"}, question="\U0001f600?")
    assert "\\ud83d\\ude00" in json.dumps(body)  # the emoji as the pair of escapes
    response = send_escaped(api, "POST", "/decide", body, AUTH)
    assert response.status_code == 200
    assert response.json["id"] == "\U0001f600"
    assert scorer.calls[0][1].state == {"\U0001f600": "\U0001f600"}


@pytest.mark.server
def test_a_lone_surrogate_id_through_gunicorn_is_a_422_envelope_logged_as_422(tmp_path):
    with fake_server(tmp_path) as server:
        status, body, headers = server.request(
            "POST", "/decide", row(id="\ud800"), {**AUTH, "X-Request-Id": "lone-1"}
        )
        assert status == 422 and int(headers["content-length"]) > 0
        assert body["error"] == {"code": "invalid_request", "message": f"id: {LONE}"}
        [line] = [
            json.loads(line)
            for line in server.log_text().splitlines()
            if '"request_id": "lone-1"' in line
        ]
        assert (line["route"], line["status"], line["error"]) == (
            "/decide",
            422,
            "invalid_request",
        )
        assert server.request("POST", "/decide", row(), AUTH)[0] == 200
