"""Concurrency, admission, framing, request ids and auth hygiene, through falcon's TestClient."""

import json
import logging
import threading

import pytest
from fakes import AUTH, TOKEN, WAIT_S, FakeScorer, decision, fake_app, row
from falcon import testing

from semif_serve.runtime.admission import InFlightLimit


def client(scorer=None, **overrides):
    app, scorer = fake_app(scorer, **overrides)
    return testing.TestClient(app), scorer


# --- concurrency ---------------------------------------------------------------------------------


def post_in_thread(api, path, body):
    responses = []
    thread = threading.Thread(
        target=lambda: responses.append(api.simulate_post(path, json=body, headers=AUTH))
    )
    thread.start()
    return thread, responses


def test_health_answers_while_a_scorer_call_is_blocked():
    api, scorer = client(FakeScorer(block=True))
    thread, responses = post_in_thread(api, "/decide", row())
    assert scorer.entered.wait(WAIT_S)
    assert api.simulate_get("/health").status_code == 200
    scorer.release.set()
    thread.join(WAIT_S)
    assert responses[0].status_code == 200


def test_scorer_calls_never_overlap():
    scorer = FakeScorer(block=True)
    api, _ = client(scorer)
    threads = [post_in_thread(api, "/decide", row(id=f"r{i}")) for i in range(4)]
    assert scorer.entered.wait(WAIT_S)
    scorer.release.set()
    for thread, _ in threads:
        thread.join(WAIT_S)
    assert [responses[0].status_code for _, responses in threads] == [200] * 4
    assert len(scorer.calls) == 4
    assert scorer.max_active == 1


def test_past_max_queue_the_next_post_is_429_before_its_body_is_read():
    scorer = FakeScorer(block=True)
    app, _ = fake_app(scorer, max_queue=1)
    api = testing.TestClient(app)
    thread, responses = post_in_thread(api, "/decide", row())
    assert scorer.entered.wait(WAIT_S)

    class SpyStream:
        read_calls = 0

        def read(self, size=-1):
            SpyStream.read_calls += 1
            return b""

    environ = testing.create_environ(
        "/decide", method="POST", headers={**AUTH, "Content-Length": "100"}
    )
    environ["wsgi.input"] = SpyStream()
    result = testing.StartResponseMock()
    body = b"".join(app(environ, result))
    assert result.status.startswith("429")
    assert json.loads(body)["error"] == {
        "code": "busy",
        "message": "1 requests are already in progress; retry later",
    }
    assert SpyStream.read_calls == 0
    assert api.simulate_get("/health").status_code == 200  # GETs are not counted
    scorer.release.set()
    thread.join(WAIT_S)
    assert responses[0].status_code == 200
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200  # slot freed


def test_a_content_length_that_is_not_ascii_digits_is_a_400_envelope():
    app, scorer = fake_app()
    for declared in ["١٠", "+10", " 10", "1_0", "0x10"]:
        environ = testing.create_environ("/decide", method="POST", headers=AUTH, body=b"{}")
        environ["CONTENT_LENGTH"] = declared
        result = testing.StartResponseMock()
        body = json.loads(b"".join(app(environ, result)))
        assert result.status.startswith("400"), declared
        assert body["error"]["code"] == "bad_request"
    assert scorer.calls == []


# --- request ids and logs ------------------------------------------------------------------------


def test_request_ids_are_echoed_or_made_and_every_request_logs_one_json_line(caplog, monkeypatch):
    from semif_serve.http import middleware

    # The access log's clock, read once when a request arrives and once when its reply is
    # ready: each duration is exactly the time between those two readings, in milliseconds.
    readings = iter([100.0, 100.0125, 200.0, 200.0005, 300.0, 300.25])
    monkeypatch.setattr(middleware, "perf_counter", lambda: next(readings))
    api, _ = client()
    with caplog.at_level(logging.INFO, logger="semif_serve.access"):
        echoed = api.simulate_post(
            "/decide", json=row(), headers={**AUTH, "X-Request-Id": "abc-123"}
        )
        made = api.simulate_get("/health", headers={"X-Request-Id": "bad id with spaces"})
        refused = api.simulate_post("/decide", json=row())
    assert echoed.headers["x-request-id"] == "abc-123"
    assert len(made.headers["x-request-id"]) == 32 and " " not in made.headers["x-request-id"]
    records = [json.loads(record.getMessage()) for record in caplog.records]
    assert [(r["route"], r["status"], r["decisions"]) for r in records] == [
        ("/decide", 200, 1),
        ("/health", 200, None),
        ("/decide", 401, None),
    ]
    assert records[0]["request_id"] == "abc-123"
    assert records[2]["error"] == "unauthorized"
    assert refused.headers["x-request-id"] == records[2]["request_id"]
    assert [r["duration_ms"] for r in records] == [12.5, 0.5, 250.0]


def test_the_token_is_compared_in_constant_time(monkeypatch):
    import hmac

    from semif_serve.http import middleware

    compared = []
    original = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return original(a, b)

    monkeypatch.setattr(middleware.hmac, "compare_digest", spy)
    api, _ = client()
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200
    assert compared == [(TOKEN.encode(), TOKEN.encode())]


def test_release_without_acquire_is_a_programming_error():
    limit = InFlightLimit(1)
    with pytest.raises(
        RuntimeError, match=r"^InFlightLimit.release\(\) without a matching acquire\(\)$"
    ):
        limit.release()
    limit.acquire()
    limit.release()
    assert limit.in_flight == 0


def test_the_log_counts_every_row_an_averaged_or_shared_request_scored(caplog):
    api, _ = client()
    shared = {"state": "s", "decisions": [decision("a"), decision("b", orderings="rotations")]}
    with caplog.at_level(logging.INFO, logger="semif_serve.access"):
        api.simulate_post("/decide", json=row(orderings="rotations"), headers=AUTH)
        api.simulate_post("/decide/shared", json=shared, headers=AUTH)
    records = [json.loads(record.getMessage()) for record in caplog.records]
    assert [(r["route"], r["status"], r["decisions"]) for r in records] == [
        ("/decide", 200, 2),
        ("/decide/shared", 200, 3),
    ]
