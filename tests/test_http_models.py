"""Model routing and management over HTTP: the model field, queue timeouts, admin-only calls."""

import threading
from urllib.parse import quote

import pytest
from fakes import AUTH, FakeScorer, decision, row, settings
from falcon import testing
from runtime_fixtures import Background, Factory, Held, spec, wait_until

from semif_serve.engine.boot import check_source as check
from semif_serve.http import create_app
from semif_serve.http.environ import DRAINING_KEY
from semif_serve.runtime.admission import MANAGEMENT_IN_FLIGHT
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.service import DecisionService
from semif_serve.server import SPARE_THREADS, gunicorn_options

ADMIN = "a" * 40
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}


def client(admin_token=ADMIN, **overrides):
    config = settings(admin_token=admin_token, parallel_slots=2, **overrides)
    factory = Factory()
    rt = Runtime(
        config,
        factory,
        [spec("a", slots=2, load_on_startup=True), spec("b")],
        "a",
        source_check=lambda spec: None if spec.source.startswith("test:") else check(config, spec),
    )
    Background(lambda: rt.start(idle_interval_s=None)).result()  # bounded, as in runtime()
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


BLANK_NAMES = ["", " ", "\t", "\u00a0\n"]
SCORING = {
    "/decide": lambda name: row(model=name),
    "/decide/shared": lambda name: {"state": "s", "decisions": [decision("d")], "model": name},
    "/v1/systemone": lambda name: {
        "model": name,
        "state": "s",
        "questions": {"q": {"type": "noul", "instructions": "Open?"}},
    },
    "/v1/decisions": lambda name: {
        "model": name,
        "input": "s",
        "questions": [{"type": "predicate", "instructions": "Open?"}],
    },
}


@pytest.mark.parametrize("name", BLANK_NAMES)
@pytest.mark.parametrize("path", list(SCORING))
def test_a_blank_model_name_is_a_422_on_every_scoring_route_never_the_default(path, name):
    """Issue 43, finding 2: "model": "" was answered by the default model."""
    api, _, factory = client()
    response = api.simulate_post(path, json=SCORING[path](name), headers=AUTH)
    assert code(response) == (422, "invalid_request")
    assert response.json["error"]["message"] == (
        "model: must name a model (a nonempty name; leave it out, or null, for the default)"
    )
    assert factory.engines["a"].scorer.calls == []


@pytest.mark.parametrize("name", BLANK_NAMES)
def test_a_blank_model_id_on_a_management_route_names_no_model(name):
    """POST /v1/models//unload (an empty path segment) unloaded the default model."""
    api, rt, _ = client()
    segment = quote(name, safe="")
    unload = api.simulate_post(f"/v1/models/{segment}/unload", headers=ADMIN_AUTH)
    assert code(unload) == (404, "model_not_found")
    assert code(put(api, segment, {"source": "test:c"}))[0] in (400, 404, 405)
    bulk = api.simulate_post("/v1/models/unload", json={"ids": [name]}, headers=ADMIN_AUTH)
    assert bulk.json == {"unloaded": [], "not_found": [name]}
    assert rt.entry("a").status()["state"] == "ready"  # the default model still serves
    assert [status["id"] for status in rt.status()] == ["a", "b"]


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
    # Without its timeout the request would queue forever (the server's own queue timeout is 0,
    # "no limit"), so it runs in a thread and must be answered within a bound.
    call = Background(lambda: api.simulate_post("/decide", json=row(timeout_s=0.05), headers=AUTH))
    try:
        answered = call.done.wait(5)
    finally:
        for holder in holders:
            holder.finish()
    assert answered, "the request ignored its timeout_s and stayed queued"
    response = call.result()
    assert code(response) == (503, "server_busy")
    assert response.headers["retry-after"] == "1"


def test_listing_models_needs_any_valid_token_and_changes_nothing():
    api, rt, _ = client()
    assert api.simulate_get("/v1/models").status_code == 401
    for headers in (AUTH, ADMIN_AUTH):
        models = api.simulate_get("/v1/models", headers=headers).json["models"]
        assert [(m["id"], m["state"]) for m in models] == [("a", "ready"), ("b", "unloaded")]


def test_listing_models_shows_each_loaded_models_prefix_cache():
    api, _, factory = client()
    stats = {"hits": 2, "misses": 1, "evictions": 0, "bytes": 1024, "entries": 1}
    factory.engines["a"].scorer.cache = stats
    models = api.simulate_get("/v1/models", headers=AUTH).json["models"]
    assert [(m["id"], m["prefix_cache"]) for m in models] == [("a", stats), ("b", None)]


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


def test_management_calls_have_a_pool_of_their_own_and_health_always_has_a_thread():
    """Issue 40, defect 8: management calls were not admitted, so slow PUTs (each holding its
    thread for a whole load) could take every spare thread, /health's included. Now at most
    MANAGEMENT_IN_FLIGHT run at once, the next is 429 busy at once, and the worker has threads
    for all of them on top of SEMIF_MAX_QUEUE's and the spare ones."""
    api, rt, factory = client()
    factory.load_gate, factory.load_started = threading.Event(), threading.Event()
    slow = [
        Background(lambda model=model: put(api, model, {"source": f"test:{model}"}))
        for model in ("c", "d")
    ]
    wait_until(
        lambda: factory.events.count(("load", "c")) + factory.events.count(("load", "d")) == 2
    )
    refused = put(api, "e", {"source": "test:e"})
    assert code(refused) == (429, "busy")
    assert refused.json["error"]["message"] == (
        "2 management calls are already in progress; retry later"
    )
    unload = api.simulate_post("/v1/models/unload", json={"ids": ["b"]}, headers=ADMIN_AUTH)
    assert code(unload) == (429, "busy")
    assert api.simulate_get("/health").status_code == 200
    assert api.simulate_get("/v1/models", headers=AUTH).status_code == 200  # GETs: no pool
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200
    factory.load_gate.set()
    assert [call.result().status_code for call in slow] == [200, 200]
    assert put(api, "e", {"source": "test:e"}).status_code == 200  # the pool is free again
    options = gunicorn_options(settings(max_queue=32))
    assert options["threads"] == 32 + MANAGEMENT_IN_FLIGHT + SPARE_THREADS


def test_health_reports_the_loaded_default_model_by_id_without_its_source():
    api, _, _ = client()
    loaded = FakeScorer().model_info()
    assert api.simulate_get("/health").json["model"] == {
        "id": "a",  # the default model's id
        **{key: loaded[key] for key in ("revision", "dtype", "device")},
    }
    listed = api.simulate_get("/v1/models", headers=AUTH).json["models"]  # the token's view
    assert [model["source"] for model in listed if model["id"] == "a"] == ["test:a"]


# --- issue 13: reconfigure and load failures, bounded management fields ---------------------------


def put(api, model_id, table):
    return api.simulate_put(f"/v1/models/{model_id}", json=table, headers=ADMIN_AUTH)


def test_a_mistyped_source_is_400_and_the_model_keeps_serving(tmp_path):
    api, rt, factory = client()
    (tmp_path / "config.json").write_text("{not json")
    for source, message in [
        ("/nonexistent/x", "a.source: model folder '/nonexistent/x' does not exist"),
        (str(tmp_path), "a.source: cannot read the config of model"),
    ]:
        response = put(api, "a", {"source": source, "device": "cpu"})
        assert code(response) == (400, "invalid_request")
        assert response.json["error"]["message"].startswith(message)
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200
    assert factory.events == [("load", "a")]


def test_a_reconfigure_whose_load_fails_is_503_model_load_failed_and_the_old_model_serves():
    api, rt, factory = client()
    factory.failing["test:a2"] = OSError("shard 2 is missing")
    response = put(api, "a", {"source": "test:a2", "device": "cpu"})
    assert code(response) == (503, "model_load_failed")
    assert response.headers["retry-after"] == "5"
    assert response.json["error"]["message"] == "loading model 'a' failed: shard 2 is missing"
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200
    [a, _] = api.simulate_get("/v1/models", headers=AUTH).json["models"]
    assert (a["state"], a["source"]) == ("ready", "test:a")
    assert a["last_load_error"]["message"] == "loading model 'a' failed: shard 2 is missing"


def test_a_model_that_cannot_load_answers_each_request_503_model_load_failed():
    api, rt, factory = client()
    factory.failing["test:b"] = OSError("weights missing")
    for _ in range(2):
        response = api.simulate_post("/decide", json=row(model="b"), headers=AUTH)
        assert code(response) == (503, "model_load_failed")
        assert response.headers["retry-after"] == "5"
    assert factory.events == [("load", "a"), ("load", "b"), ("load", "b")]  # each one retried


def test_health_is_503_while_the_default_model_cannot_load_and_no_caller_sees_a_path():
    """Issue 43, finding 4: with the default model's folder gone every request got 503 while
    /health said 200 "ok", and the 503 showed the server's folder path to any token holder."""
    api, rt, factory = client()
    assert api.simulate_post("/v1/models/a/unload", headers=ADMIN_AUTH).status_code == 200
    assert api.simulate_get("/health").status_code == 200  # unloaded: it loads on demand
    factory.failing["test:a"] = OSError("/srv/models/a/config.json: no such file")
    response = api.simulate_post("/decide", json=row(), headers=AUTH)
    assert code(response) == (503, "model_load_failed")
    assert response.json["error"]["message"] == (
        "loading model 'a' failed (OSError); its last_load_error in GET /v1/models and the "
        "server's log say why"
    )
    health = api.simulate_get("/health")
    assert health.status_code == 503 and api.simulate_head("/health").status_code == 503
    assert (health.json["status"], health.json["reason"]) == ("unavailable", "model_load_failed")
    assert "/srv" not in health.text
    [listed] = [
        m for m in api.simulate_get("/v1/models", headers=AUTH).json["models"] if m["id"] == "a"
    ]
    assert "/srv/models/a/config.json" in listed["last_load_error"]["message"]
    del factory.failing["test:a"]
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200
    assert api.simulate_get("/health").json["status"] == "ok"
    assert "reason" not in api.simulate_get("/health").json


@pytest.mark.parametrize("load_failed", [False, True])
def test_health_is_503_draining_once_the_worker_began_its_shutdown(load_failed):
    """The worker marks the requests it answers while it shuts down (DRAINING_KEY): a probe
    among them must not read "ok" (the real drain: test_server.py)."""
    api, rt, factory = client()
    if load_failed:  # draining says more than the failed load: the server is going away
        api.simulate_post("/v1/models/a/unload", headers=ADMIN_AUTH)
        factory.failing["test:a"] = OSError("gone")
        api.simulate_post("/decide", json=row(), headers=AUTH)
    for method in (api.simulate_get, api.simulate_head):
        health = method("/health", extras={DRAINING_KEY: True})
        assert health.status_code == 503
    health = api.simulate_get("/health", extras={DRAINING_KEY: True}).json
    assert (health["status"], health["reason"]) == ("unavailable", "draining")
    assert health["model"]["id"] == "a" and "max_tokens" in health
    assert api.simulate_get("/health", extras={DRAINING_KEY: False}).status_code == (
        503 if load_failed else 200
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("max_tokens", 10**400, "c.max_tokens: must be an integer >= 1 and <= 1048576, got 1000"),
        ("max_tokens", (1 << 20) + 1, "c.max_tokens: must be an integer >= 1 and <= 1048576"),
        ("keep_alive_s", 10**400, "c.keep_alive_s: must be a number of seconds > 0 and <= "),
        ("keep_alive_s", 30 * 24 * 3600 + 1, "c.keep_alive_s: must be a number of seconds"),
        ("slots", 10**400, "c.slots: must be an integer 1..16, got 1000"),
    ],
)
def test_absurd_numbers_in_a_model_table_are_400_naming_the_field(key, value, message):
    api, _, factory = client()
    response = put(api, "c", {"source": "test:c", "device": "cpu", key: value})
    assert code(response) == (400, "invalid_request")
    assert response.json["error"]["message"].startswith(message)
    assert len(response.json["error"]["message"]) < 200  # a 400-digit number is not echoed
    assert factory.events == [("load", "a")]


def test_the_largest_bounded_values_are_accepted():
    api, rt, _ = client()
    table = {"source": "test:c", "device": "cpu", "max_tokens": 1 << 20}
    response = put(api, "c", {**table, "keep_alive_s": 30 * 24 * 3600, "slots": 2})
    assert response.status_code == 200 and response.json["keep_alive_s"] == 30 * 24 * 3600
    assert rt.entry("c").spec.max_tokens == 1 << 20


@pytest.mark.parametrize(
    "body", [{"ids": "a"}, {"ids": ["a", 1]}, {"ids": ["a"], "extra": 1}, {}, {"id": ["a"]}]
)
def test_a_bulk_unload_body_must_be_a_list_of_ids_only(body):
    api, rt, factory = client()
    response = api.simulate_post("/v1/models/unload", json=body, headers=ADMIN_AUTH)
    assert code(response) == (422, "invalid_request")
    assert response.json["error"]["message"] == 'body: must be {"ids": [model id, ...]}'
    assert rt.entry("a").status()["state"] == "ready"


def test_a_bulk_unload_of_no_ids_unloads_nothing():
    api, rt, _ = client()
    response = api.simulate_post("/v1/models/unload", json={"ids": []}, headers=ADMIN_AUTH)
    assert response.json == {"unloaded": [], "not_found": []}
    assert rt.entry("a").status()["state"] == "ready"


def test_management_bodies_are_held_to_the_body_limit():
    api, rt, factory = client(max_body_bytes=200)
    table = {"source": "test:c", "device": "cpu", "revision": "x" * 200}
    assert code(put(api, "c", table)) == (413, "request_too_large")
    bulk = {"ids": ["x" * 200]}
    response = api.simulate_post("/v1/models/unload", json=bulk, headers=ADMIN_AUTH)
    assert code(response) == (413, "request_too_large")
    assert put(api, "c", {"source": "test:c", "device": "cpu"}).status_code == 200
