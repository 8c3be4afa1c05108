"""A request whose client has gone is dropped before scoring (issue 21, finding 4): the worker
puts a `semif.client_gone` check in the WSGI environ; the service calls it once it holds the
model, just before the engine call. Real sockets: tests/test_hostile_wire.py."""

import json
import logging
import threading

import pytest
from fakes import AUTH, WAIT_S, FakeScorer, decision, fake_app, row
from falcon import testing
from prometheus_client.parser import text_string_to_metric_families

from semif_serve.http.environ import CLIENT_GONE_KEY


def abandoned_total(api) -> float:
    page = api.simulate_get("/metrics").text
    for family in text_string_to_metric_families(page):
        if family.name == "semif_requests_abandoned":
            return sum(sample.value for sample in family.samples if sample.name.endswith("_total"))
    raise AssertionError("semif_requests_abandoned is not on /metrics")


BODIES = {
    "/decide": row(),
    "/decide?orderings": row(orderings="rotations"),
    "/decide/shared": {"state": {"door": "open"}, "decisions": [decision("a"), decision("b")]},
}


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_request_whose_client_left_is_dropped_before_scoring(path, caplog):
    app, scorer = fake_app()
    api = testing.TestClient(app)
    checks = []

    def gone() -> bool:
        checks.append(len(scorer.calls))
        return True

    with caplog.at_level(logging.INFO, logger="semif_serve.access"):
        response = api.simulate_post(
            path.split("?")[0], json=BODIES[path], headers=AUTH, extras={CLIENT_GONE_KEY: gone}
        )
    assert response.status_code == 499
    assert response.json["error"] == {
        "code": "client_closed_request",
        "message": "the client closed its connection before its request was scored",
    }
    assert scorer.calls == [] and checks == [0]  # asked once, before any engine call
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == "semif_serve.access"]
    assert [(line["status"], line.get("error")) for line in lines] == [
        (499, "client_closed_request")
    ]
    assert abandoned_total(api) == 1
    assert app.metrics is not None


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_request_whose_client_is_still_there_is_scored(path):
    app, scorer = fake_app()
    api = testing.TestClient(app)
    response = api.simulate_post(
        path.split("?")[0], json=BODIES[path], headers=AUTH, extras={CLIENT_GONE_KEY: lambda: False}
    )
    assert response.status_code == 200, response.text
    assert len(scorer.calls) == 1
    assert abandoned_total(api) == 0


def test_without_a_check_in_the_environ_requests_are_scored():
    app, scorer = fake_app()
    response = testing.TestClient(app).simulate_post("/decide", json=row(), headers=AUTH)
    assert response.status_code == 200 and len(scorer.calls) == 1


def test_a_dropped_request_frees_its_slot_for_the_next():
    app, scorer = fake_app(max_queue=1)
    api = testing.TestClient(app)
    first = api.simulate_post(
        "/decide", json=row(), headers=AUTH, extras={CLIENT_GONE_KEY: lambda: True}
    )
    assert first.status_code == 499
    second = api.simulate_post("/decide", json=row(), headers=AUTH)
    assert second.status_code == 200 and len(scorer.calls) == 1


@pytest.mark.parametrize("path", sorted(BODIES))
def test_a_queued_request_whose_client_left_leaves_while_the_model_is_busy(path):
    scorer = FakeScorer(block=True)
    app, _ = fake_app(scorer)
    api = testing.TestClient(app)
    holder = threading.Thread(
        target=api.simulate_post, args=("/decide",), kwargs={"json": row(), "headers": AUTH}
    )
    holder.start()
    try:
        assert scorer.entered.wait(WAIT_S)
        left = threading.Event()
        replies = []

        def queued() -> None:
            response = api.simulate_post(
                path.split("?")[0],
                json=BODIES[path],
                headers=AUTH,
                extras={CLIENT_GONE_KEY: left.is_set},
            )
            replies.append(response)

        waiter = threading.Thread(target=queued)
        waiter.start()
        left.set()
        waiter.join(WAIT_S)  # answered while the holder still holds the model
        assert not waiter.is_alive() and not scorer.release.is_set()
        assert replies[0].status_code == 499
        assert replies[0].json["error"]["code"] == "client_closed_request"
    finally:
        scorer.release.set()
        holder.join(WAIT_S)
    assert len(scorer.calls) == 1  # the holder's only
