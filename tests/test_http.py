"""The contract's HTTP tests, through falcon's TestClient with a fake scorer (no torch, no model)."""

import json
import logging

import pytest
from fakes import AUTH, TOKEN, FakeScorer, decision, fake_app, row
from falcon import testing
from prometheus_client.parser import text_string_to_metric_families

from semif_serve.errors import OutOfMemory
from semif_serve.http.resources import non_finite_message, non_finite_paths
from semif_serve.runtime.service import SEMIF_COMMIT
from semif_serve.scoring.prompt import PromptRejected
from semif_serve.scoring.rows import RowError


def client(scorer=None, **overrides):
    app, scorer = fake_app(scorer, **overrides)
    return testing.TestClient(app), scorer


def assert_error(response, status, code):
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert set(response.json) == {"error"}
    assert set(response.json["error"]) == {"code", "message"}
    assert response.json["error"]["code"] == code
    assert response.json["error"]["message"]
    return response.json["error"]["message"]


# --- auth -----------------------------------------------------------------------------------


def test_health_needs_no_token_and_reports_the_service():
    api, _ = client(calibration={"triage": 1.5}, vram_cap_gib=6.0)
    response = api.simulate_get("/health")
    assert response.status_code == 200
    assert response.json == {
        "status": "ok",
        "semif_commit": SEMIF_COMMIT,
        "model": {"id": "default", "revision": "0" * 40, "dtype": "float32", "device": "cpu"},
        "vram_cap_gib": 6.0,
        "max_tokens": 4096,
        "max_decisions": 64,
        "workloads": {"triage": 1.5},
    }


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": TOKEN},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": f"Bearer {TOKEN[:-1]}x"},
        {"Authorization": f"Bearer {TOKEN}extra"},
        {"Authorization": "Bearer"},
    ],
)
@pytest.mark.parametrize("path", ["/decide", "/decide/shared"])
def test_posts_need_the_bearer_token(headers, path):
    api, scorer = client()
    response = api.simulate_post(path, json=row(), headers=headers)
    assert assert_error(response, 401, "unauthorized") == "missing or wrong bearer token"
    assert response.headers["www-authenticate"] == "Bearer"
    assert scorer.calls == []


def test_the_bearer_scheme_is_case_insensitive_and_spaces_around_the_token_are_ignored():
    api, _ = client()
    for header in (f"bearer {TOKEN}", f"Bearer  {TOKEN} "):
        response = api.simulate_post("/decide", json=row(), headers={"Authorization": header})
        assert response.status_code == 200, header


def test_a_token_with_characters_outside_latin_1_is_refused_not_a_crash():
    api, scorer = client()
    response = api.simulate_post(
        "/decide", json=row(), headers={"Authorization": f"Bearer {TOKEN[:-1]}\u2603"}
    )
    assert_error(response, 401, "unauthorized")
    assert scorer.calls == []


def test_unknown_routes_and_methods_get_the_envelope():
    api, _ = client()
    assert_error(api.simulate_get("/nope"), 401, "unauthorized")  # no route list for strangers
    assert "GET /nope" in assert_error(api.simulate_get("/nope", headers=AUTH), 404, "not_found")
    response = api.simulate_get("/decide", headers=AUTH)
    assert_error(response, 405, "method_not_allowed")
    assert "POST" in response.headers["allow"]


# --- /decide and /decide/shared pass scores through ------------------------------------------


def test_decide_passes_the_row_through_and_returns_the_scorer_dict_unchanged():
    scorer = FakeScorer(base={"Yes": 2.0})
    api, _ = client(scorer)
    response = api.simulate_post("/decide", json=row(), headers=AUTH)
    assert response.status_code == 200
    [(method, scored)] = scorer.calls
    assert method == "score"
    assert (scored.id, scored.state, scored.question) == (
        "r1",
        {"door": "open"},
        "Is the door open?",
    )
    assert [(o.id, o.description) for o in scored.options] == [("o0", "Yes"), ("o1", "No")]
    assert response.json == scorer.result(scored)
    assert "calibrated" not in response.json


def test_replies_keep_non_ascii_text_as_is():
    api, _ = client()
    response = api.simulate_post("/decide", json=row(id="café"), headers=AUTH)
    assert response.status_code == 200 and '"id": "café"' in response.text
    response = api.simulate_post("/decide", json=row(workload="thé"), headers=AUTH)
    assert "unknown workload 'thé'" in assert_error(response, 422, "invalid_request")
    assert "thé" in response.text


def test_decide_shared_builds_rows_with_the_shared_state_and_returns_results_and_timing():
    scorer = FakeScorer()
    api, _ = client(scorer)
    body = {
        "state": "the shared state",
        "decisions": [decision("a"), decision("b", ("X", "Y", "Z"))],
    }
    response = api.simulate_post("/decide/shared", json=body, headers=AUTH)
    assert response.status_code == 200
    [(method, rows)] = scorer.calls
    assert method == "score_shared"
    assert [(r.id, r.state, len(r.options)) for r in rows] == [
        ("a", "the shared state", 2),
        ("b", "the shared state", 3),
    ]
    assert response.json == {
        "results": [scorer.result(r) for r in rows],
        "timing": scorer.timing(rows),
    }


# --- calibration ---------------------------------------------------------------------------------


def test_calibration_adds_a_calibrated_block_and_keeps_the_argmax_and_native_fields():
    scorer = FakeScorer(base={"Yes": 1.0, "No": 3.0, "Maybe": 0.5})
    api, _ = client(scorer, calibration={"triage": 2.0})
    body = row(options=("Yes", "No", "Maybe"), workload="triage")
    response = api.simulate_post("/decide", json=body, headers=AUTH)
    assert response.status_code == 200
    native = scorer.result(scorer.calls[0][1])
    reply = response.json
    calibrated = reply.pop("calibrated")
    assert reply == native
    assert calibrated["workload"] == "triage" and calibrated["temperature"] == 2.0
    expected = [0.5, 1.5, 0.25]  # logits / T
    total = sum(2.718281828459045**v for v in expected)
    assert calibrated["probabilities"] == pytest.approx(
        [2.718281828459045**v / total for v in expected], rel=1e-12
    )
    argmax = lambda values: values.index(max(values))  # noqa: E731
    assert argmax(calibrated["probabilities"]) == argmax(native["probabilities"]) == 1


def test_calibration_applies_to_every_shared_result():
    api, _ = client(calibration={"triage": 0.5})
    body = {"state": "s", "decisions": [decision("a"), decision("b")], "workload": "triage"}
    results = api.simulate_post("/decide/shared", json=body, headers=AUTH).json["results"]
    assert [r["calibrated"]["workload"] for r in results] == ["triage", "triage"]


@pytest.mark.parametrize("path", ["/decide", "/decide/shared"])
def test_an_unknown_workload_is_422(path):
    api, scorer = client(calibration={"triage": 1.0})
    body = (
        row(workload="nope")
        if path == "/decide"
        else {"state": "s", "decisions": [decision("a")], "workload": "nope"}
    )
    assert "unknown workload 'nope'" in assert_error(
        api.simulate_post(path, json=body, headers=AUTH), 422, "invalid_request"
    )
    assert scorer.calls == []


# --- failures map to the error table -------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (RowError("max_tokens: the prompt has 5000 tokens"), 422, "invalid_request"),
        (PromptRejected("letter guard: letters share a token"), 422, "invalid_request"),
        (OutOfMemory("CUDA out of memory"), 503, "out_of_memory"),
        # torch or transformers refusing something is the server's fault, never the caller's
        (ValueError("Expected input batch_size (1) to match"), 500, "scoring_failed"),
        (RuntimeError("DefaultCPUAllocator: can't allocate memory: 9 GB"), 503, "out_of_memory"),
        (RuntimeError("kernel exploded"), 500, "scoring_failed"),
        (KeyError("boom"), 500, "scoring_failed"),
    ],
)
def test_scorer_failures_map_to_the_error_table(error, status, code):
    api, _ = client(FakeScorer(error=error))
    message = assert_error(api.simulate_post("/decide", json=row(), headers=AUTH), status, code)
    if status == 422:
        assert message == str(error)  # the scorer's own words, naming the field or guard
    assert api.simulate_get("/health").status_code == 200  # and the service stays up


def test_a_scorer_value_error_in_a_shared_call_names_the_decision():
    error = RowError("rows[1]: max_tokens: the prompt has 5000 tokens", row_index=1)
    api, _ = client(FakeScorer(error=error))
    body = {"state": "s", "decisions": [decision("a"), decision("b")]}
    message = assert_error(
        api.simulate_post("/decide/shared", json=body, headers=AUTH), 422, "invalid_request"
    )
    assert message == "decisions[1] (row 'b'): max_tokens: the prompt has 5000 tokens"


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "body: not valid JSON"),
        (b"[1, 2]", "body: must be a JSON object, got list"),
        (b'"text"', "body: must be a JSON object, got str"),
        (b'{"id": NaN}', "body: not valid JSON: NaN is not valid JSON"),
        (b"\xff\xfe", "body: must be UTF-8 encoded JSON"),
        (b"", "body: not valid JSON"),
        (json.dumps({**row(), "extra": 1}).encode(), "body: unknown keys ['extra']"),
        (json.dumps({**row(), "options": []}).encode(), "options: must hold 2..16 items"),
        (json.dumps({**row(), "id": 5}).encode(), "id: must be a string"),
        (json.dumps({**row(), "workload": 3}).encode(), "workload: must be a string"),
    ],
)
def test_malformed_bodies_are_422(body, fragment):
    api, scorer = client()
    message = assert_error(
        api.simulate_post("/decide", body=body, headers=AUTH), 422, "invalid_request"
    )
    assert message.startswith(fragment)
    assert scorer.calls == []


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"decisions": [decision("a")]}, "state: missing"),
        ({"state": "", "decisions": [decision("a")]}, "state: must be a nonempty"),
        ({"state": "s", "decisions": "a"}, "decisions: must be an array"),
        ({"state": "s"}, "decisions: must be an array"),
        ({"state": "s", "decisions": []}, "decisions: must hold 1..64 entries, got 0"),
        ({"state": "s", "decisions": [decision("a"), 7]}, "decisions[1]: must be an object"),
        (
            {"state": "s", "decisions": [{**decision("a"), "state": "x"}]},
            "decisions[0].: unknown keys ['state']",
        ),
        (
            {"state": "s", "decisions": [decision("a", ("Only",))]},
            "decisions[0].options: must hold 2..16",
        ),
        (
            {"state": "s", "decisions": [decision("a"), decision("a")]},
            "decisions[1].id: 'a' is already used by decisions[0]",
        ),
        ({"state": "s", "decisions": [decision("a")], "extra": 1}, "body: unknown keys ['extra']"),
    ],
)
def test_malformed_shared_bodies_are_422(body, fragment):
    api, scorer = client()
    message = assert_error(
        api.simulate_post("/decide/shared", json=body, headers=AUTH), 422, "invalid_request"
    )
    assert message.startswith(fragment)
    assert scorer.calls == []


def test_too_many_decisions_is_422():
    api, scorer = client(max_decisions=3)
    body = {"state": "s", "decisions": [decision(f"d{i}") for i in range(4)]}
    assert "decisions: must hold 1..3 entries, got 4" in assert_error(
        api.simulate_post("/decide/shared", json=body, headers=AUTH), 422, "invalid_request"
    )
    body["decisions"] = body["decisions"][:3]
    assert api.simulate_post("/decide/shared", json=body, headers=AUTH).status_code == 200


def test_an_oversized_body_is_413():
    api, scorer = client(max_body_bytes=200)
    body = json.dumps(row(options=("Yes" * 100, "No"))).encode()
    assert len(body) > 200
    assert_error(api.simulate_post("/decide", body=body, headers=AUTH), 413, "request_too_large")
    assert scorer.calls == []


def test_a_failure_while_building_the_response_is_a_500_envelope():
    # C3: calibration cannot read these logits; the caller still gets the envelope.
    class Broken(FakeScorer):
        def result(self, row):
            return {**super().result(row), "option_logits": ["not", "numbers"]}

    api, _ = client(Broken(), calibration={"triage": 1.0})
    message = assert_error(
        api.simulate_post("/decide", json=row(workload="triage"), headers=AUTH),
        500,
        "scoring_failed",
    )
    assert message.startswith("building the response failed: TypeError: ")


def test_a_scorer_returning_the_wrong_number_of_results_is_a_500_envelope():
    class Short(FakeScorer):
        def score_shared(self, rows):
            results, timing = super().score_shared(rows)
            return results[:1], timing

    api, _ = client(Short())
    body = {"state": "s", "decisions": [decision("a"), decision("b")]}
    message = assert_error(
        api.simulate_post("/decide/shared", json=body, headers=AUTH), 500, "scoring_failed"
    )
    assert message == "the scorer returned 1 results for 2 rows"


@pytest.mark.parametrize(
    ("extra", "index", "expected"),
    [
        ({}, 0, "request (row 'r1'): too long"),
        ({"orderings": "rotations"}, 1, "request (row 'r1#o1'): too long"),
    ],
)
def test_a_scorer_value_error_on_decide_names_its_row(extra, index, expected):
    error = RowError(f"rows[{index}]: too long", row_index=index)
    api, _ = client(FakeScorer(error=error))
    response = api.simulate_post("/decide", json=row(**extra), headers=AUTH)
    assert assert_error(response, 422, "invalid_request") == expected


def test_a_reply_that_cannot_render_as_json_is_a_500_envelope():
    class Unrenderable(FakeScorer):
        def result(self, row):
            return {**super().result(row), "summary": {"a set"}}

    api, _ = client(Unrenderable())
    assert "could not be rendered" in assert_error(
        api.simulate_post("/decide", json=row(), headers=AUTH), 500, "scoring_failed"
    )


def test_a_non_finite_score_is_a_500_envelope_saying_so(caplog):
    """Issue 30: a model that makes NaN (for some inputs) answered "Out of range float values
    are not JSON compliant"; the 500 now says the model's scores were not finite, and where."""

    class NaNScorer(FakeScorer):
        def result(self, row):
            return {**super().result(row), "probabilities": [float("nan"), float("inf")]}

    api, _ = client(NaNScorer())
    message = assert_error(
        api.simulate_post("/decide", json=row(), headers=AUTH), 500, "scoring_failed"
    )
    assert message == (
        "the model produced non-finite scores (NaN or infinity at probabilities[0], "
        "probabilities[1]); its weights may be corrupt"
    )
    assert [r.getMessage() for r in caplog.records if "non-finite" in r.getMessage()] == [
        "the model produced non-finite scores at probabilities[0], probabilities[1]: replied 500"
    ]


def test_non_finite_places_are_named_in_document_order_and_past_four_counted():
    assert non_finite_paths(float("-inf")) == ["the reply"]  # a bare number has no path
    places = [f"p[{index}]" for index in range(6)]
    assert non_finite_message(places) == (
        "the model produced non-finite scores (NaN or infinity at p[0], p[1], p[2], p[3] and 2 "
        "more); its weights may be corrupt"
    )


def test_a_reply_that_cannot_encode_as_utf_8_is_a_500_envelope_logged_and_counted_as_500(caplog):
    # Issue 21, finding 5: text UTF-8 cannot encode failed inside Falcon after the access log and
    # /metrics had recorded 200, and the client got a 500 without a body.
    class Unencodable(FakeScorer):
        def result(self, row):
            return {**super().result(row), "summary": "half a pair: \ud800"}

    caplog.set_level(logging.INFO, logger="semif_serve.access")
    api, _ = client(Unencodable())
    response = api.simulate_post("/decide", json=row(), headers={**AUTH, "X-Request-Id": "u-1"})
    message = assert_error(response, 500, "scoring_failed")
    assert message.startswith("the response could not be rendered as JSON: 'utf-8' codec can't")
    assert int(response.headers["content-length"]) == len(response.content)
    [line] = [json.loads(r.getMessage()) for r in caplog.records if r.name == "semif_serve.access"]
    assert (line["request_id"], line["status"], line["error"]) == ("u-1", 500, "scoring_failed")
    metrics = text_string_to_metric_families(api.simulate_get("/metrics").text)
    counted = {
        sample.labels["status"]: sample.value
        for family in metrics
        for sample in family.samples
        if sample.name == "semif_requests_total" and sample.labels["route"] == "/decide"
    }
    assert counted == {"500": 1}


# --- HEAD (issue 21, finding 6) ----------------------------------------------------------------


def without_request_id(headers):
    ids = ("x-request-id", "x-typesafe-request-id")
    return {name: value for name, value in headers.items() if name not in ids}


@pytest.mark.parametrize(("path", "headers"), [("/health", {}), ("/v1/models", AUTH)])
def test_head_answers_as_get_with_the_same_status_and_headers_and_no_body(path, headers):
    api, _ = client()
    got = api.simulate_get(path, headers=headers)
    head = api.simulate_head(path, headers=headers)
    assert (head.status_code, got.status_code) == (200, 200)
    assert head.content == b""
    assert without_request_id(head.headers) == without_request_id(got.headers)
    assert int(head.headers["content-length"]) == len(got.content) > 0


def test_head_metrics_needs_no_token_and_sends_no_body():
    api, _ = client()
    head = api.simulate_head("/metrics")
    assert head.status_code == 200 and head.content == b""
    assert head.headers["content-type"] == api.simulate_get("/metrics").headers["content-type"]
    assert int(head.headers["content-length"]) > 0


def test_head_keeps_the_get_routes_auth_and_other_routes_refuse_it():
    api, scorer = client()
    response = api.simulate_head("/v1/models")
    assert (response.status_code, response.content) == (401, b"")
    assert response.headers["www-authenticate"] == "Bearer"
    response = api.simulate_head("/decide", headers=AUTH)
    assert (response.status_code, response.content) == (405, b"")
    assert "HEAD" not in response.headers["allow"]
    assert api.simulate_head("/decide").status_code == 401
    assert scorer.calls == []
