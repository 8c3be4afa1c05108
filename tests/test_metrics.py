"""GET /metrics: Prometheus text with requests, rejections, latency and model lifecycle."""

from fakes import AUTH, row, scrape, settings
from falcon import testing
from runtime_fixtures import Factory, spec

from semif_serve.http import create_app
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.service import DecisionService


def test_requests_rejections_model_states_and_events_are_exported():
    config = settings(parallel_slots=1, max_loaded_models=1)
    rt = Runtime(config, Factory(), [spec("a", load_on_startup=True), spec("b")], "a")
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    rt.start(idle_interval_s=None)
    api.simulate_post("/decide", json=row(), headers=AUTH)
    api.simulate_post("/decide", json=row())  # 401
    api.simulate_post("/decide", json=row(model="b"), headers=AUTH)  # evicts a
    samples = scrape(api)
    assert samples[("semif_requests_total", (("route", "/decide"), ("status", "200")))] == 2
    assert samples[("semif_requests_total", (("route", "/decide"), ("status", "401")))] == 1
    assert samples[("semif_rejections_total", (("reason", "unauthorized"),))] == 1
    assert samples[("semif_request_seconds_count", (("route", "/decide"),))] == 3
    assert samples[("semif_model_state", (("model", "a"), ("state", "unloaded")))] == 1
    assert samples[("semif_model_state", (("model", "b"), ("state", "ready")))] == 1
    assert samples[("semif_model_events_total", (("event", "evict"), ("model", "a")))] == 1
    assert samples[("semif_model_events_total", (("event", "load"), ("model", "b")))] == 1
    assert samples[("semif_model_queued_requests", (("model", "b"),))] == 0
    assert samples[("semif_requests_in_progress", ())] == 0


def test_unknown_paths_share_one_label():
    config = settings()
    rt = Runtime(config, Factory(), [spec("a")], "a")
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    for path in ("/x1", "/x2", "/x3"):
        api.simulate_get(path, headers=AUTH)
    samples = scrape(api)
    assert samples[("semif_requests_total", (("route", "unmatched"), ("status", "404")))] == 3


def test_each_loaded_models_prefix_cache_is_exported():
    config = settings(parallel_slots=1)
    factory = Factory()
    rt = Runtime(config, factory, [spec("a", load_on_startup=True), spec("b")], "a")
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    rt.start(idle_interval_s=None)
    factory.engines["a"].scorer.cache = {
        "hits": 7,
        "partial_hits": 5,
        "misses": 3,
        "evictions": 1,
        "reused_tokens": 9000,
        "prefilled_tokens": 800,
        "bytes": 4096,
        "entries": 2,
        "checkpoints": 6,
    }
    samples = scrape(api)
    model_a = (("model", "a"),)
    assert samples[("semif_prefix_cache_hits_total", model_a)] == 7
    assert samples[("semif_prefix_cache_partial_hits_total", model_a)] == 5
    assert samples[("semif_prefix_cache_reused_tokens_total", model_a)] == 9000
    assert samples[("semif_prefix_cache_prefilled_tokens_total", model_a)] == 800
    assert samples[("semif_prefix_cache_checkpoints", model_a)] == 6
    assert samples[("semif_prefix_cache_misses_total", model_a)] == 3
    assert samples[("semif_prefix_cache_evictions_total", model_a)] == 1
    assert samples[("semif_prefix_cache_bytes", model_a)] == 4096
    assert samples[("semif_prefix_cache_entries", model_a)] == 2
    # b is not loaded: no cache figures (not zeros that would read as a cold cache)
    assert not [
        key for key in samples if key[0].startswith("semif_prefix_cache") and key[1] != model_a
    ]


def test_the_startup_load_is_counted_though_it_ran_before_the_app_existed():
    """Issue 24: production loads the startup models, then builds the app and its metrics."""
    config = settings()
    rt = Runtime(config, Factory(), [spec("a", load_on_startup=True)], "a")
    rt.start(idle_interval_s=None)  # before create_app, as server.production_app does
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    api.simulate_post("/decide", json=row(), headers=AUTH)
    samples = scrape(api)
    assert samples[("semif_model_events_total", (("event", "load"), ("model", "a")))] == 1
    rt.unload("a")
    samples = scrape(api)
    assert samples[("semif_model_events_total", (("event", "unload"), ("model", "a")))] == 1
    assert samples[("semif_model_events_total", (("event", "load"), ("model", "a")))] == 1
