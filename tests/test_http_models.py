"""Model routing and management over HTTP: the model field, queue timeouts, admin-only calls."""

import pytest
from fakes import AUTH, FakeScorer, row, settings
from falcon import testing
from runtime_fixtures import Background, Factory, Held, spec

from semif_serve.http import create_app
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.service import DecisionService

ADMIN = "a" * 40
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


def client(admin_token=ADMIN, **overrides):
    config = settings(admin_token=admin_token, parallel_slots=2, **overrides)
    factory = Factory()
    rt = Runtime(config, factory, [spec("a", slots=2, load_on_startup=True), spec("b")], "a")
    rt.start(idle_interval_s=None)
    return testing.TestClient(create_app(DecisionService(rt, config), config)), rt, factory


def code(response):
    return response.status_code, response.json["error"]["code"]


def test_decide_goes_to_the_default_model_or_the_named_one():
    api, rt, factory = client()
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200
    assert api.simulate_post("/decide", json=row(model="b"), headers=AUTH).status_code == 200
    body = {
        "state": "s",
        "decisions": [{"id": "x", "question": "q", "options": row()["options"]}],
        "model": "b",
    }
    assert api.simulate_post("/decide/shared", json=body, headers=AUTH).status_code == 200
    assert factory.events == [("load", "a"), ("load", "b")]
    assert len(factory.engines["b"].scorer.calls) == 2


def test_an_unknown_model_is_404_model_not_found():
    api, _, _ = client()
    assert code(api.simulate_post("/decide", json=row(model="nope"), headers=AUTH)) == (
        404,
        "model_not_found",
    )


@pytest.mark.parametrize("value", [0, -1, "5", True])
def test_timeout_s_must_be_a_positive_number(value):
    api, _, _ = client()
    response = api.simulate_post("/decide", json=row(timeout_s=value), headers=AUTH)
    assert code(response) == (422, "invalid_request")


def test_a_request_that_waits_past_its_timeout_is_503_server_busy_with_retry_after():
    api, rt, _ = client()
    holders = [Held(rt, "a"), Held(rt, "a")]  # both slots of a
    for holder in holders:
        assert holder.admitted.wait(10)
    response = api.simulate_post("/decide", json=row(timeout_s=0.05), headers=AUTH)
    assert code(response) == (503, "server_busy")
    assert response.headers["retry-after"] == "1"
    for holder in holders:
        holder.finish()


def test_listing_models_needs_any_valid_token_and_changes_nothing():
    api, rt, _ = client()
    assert api.simulate_get("/v1/models").status_code == 401
    for headers in (AUTH, ADMIN_AUTH):
        models = api.simulate_get("/v1/models", headers=headers).json["models"]
        assert [(m["id"], m["state"]) for m in models] == [("a", "ready"), ("b", "unloaded")]


@pytest.mark.parametrize("admin_token", [ADMIN, None])
def test_management_without_the_admin_token_is_403(admin_token):
    api, _, factory = client(admin_token=admin_token)
    calls = [
        api.simulate_put("/v1/models/c", json={"source": "x"}, headers=AUTH),
        api.simulate_post("/v1/models/a/unload", headers=AUTH),
        api.simulate_post("/v1/models/unload", json={"ids": ["a"]}, headers=AUTH),
    ]
    assert [code(c) for c in calls] == [(403, "forbidden")] * 3
    assert {c.json["error"]["message"] for c in calls} == {
        "model management needs the admin token (SEMIF_ADMIN_TOKEN)"
    }
    assert factory.events == [("load", "a")]
    if admin_token is None:  # unset: nobody manages, and the admin bearer is just a wrong token
        assert api.simulate_post("/v1/models/a/unload", headers=ADMIN_AUTH).status_code == 401


def test_the_admin_registers_unloads_and_bulk_unloads():
    api, rt, factory = client()
    registered = api.simulate_put(
        "/v1/models/c", json={"source": "test:c", "device": "cpu"}, headers=ADMIN_AUTH
    )
    assert registered.status_code == 200 and registered.json["state"] == "ready"
    assert api.simulate_post("/v1/models/a/unload", headers=ADMIN_AUTH).json == {
        "id": "a",
        "loaded": False,
    }
    assert code(api.simulate_post("/v1/models/zz/unload", headers=ADMIN_AUTH)) == (
        404,
        "model_not_found",
    )
    bulk = api.simulate_post("/v1/models/unload", json={"ids": ["c", "zz"]}, headers=ADMIN_AUTH)
    assert bulk.json == {"unloaded": ["c"], "not_found": ["zz"]}
    assert code(api.simulate_post("/v1/models/unload", json={"ids": "c"}, headers=ADMIN_AUTH)) == (
        422,
        "invalid_request",
    )
    assert code(api.simulate_put("/v1/models/c", json={"slots": 2}, headers=ADMIN_AUTH)) == (
        400,
        "invalid_request",
    )


def test_management_calls_do_not_count_toward_max_queue():
    api, rt, factory = client(max_queue=1)
    holder = Held(rt, "b")
    assert holder.admitted.wait(10)
    assert api.simulate_get("/v1/models", headers=AUTH).status_code == 200
    assert api.simulate_post("/v1/models/a/unload", headers=ADMIN_AUTH).status_code == 200
    holder.finish()
    # With the one POST slot taken by a scoring request, management still gets through.
    scorer = factory.engines["b"].scorer
    scorer.release.clear()
    scoring = Background(lambda: api.simulate_post("/decide", json=row(model="b"), headers=AUTH))
    assert scorer.entered.wait(10)
    assert code(api.simulate_post("/decide", json=row(model="b"), headers=AUTH)) == (429, "busy")
    assert api.simulate_post("/v1/models/a/unload", headers=ADMIN_AUTH).status_code == 200
    scorer.release.set()
    assert scoring.result().status_code == 200


def test_health_reports_the_loaded_default_model():
    api, _, _ = client()
    assert api.simulate_get("/health").json["model"] == FakeScorer().model_info()
