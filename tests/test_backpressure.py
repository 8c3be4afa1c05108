"""Issue 39: honest backpressure. Each model's pace, measured on its served engine calls, estimates
how long its queue takes to drain: a refusal (429/503) says so in Retry-After, and a request
whose deadline that wait would pass is refused at once instead of queueing to be abandoned.

Timing runs on fake clocks (`runtime_fixtures.Clock`); every hand-off is an event or a condition
bounded by WAIT_S. The one real-time wait is a 0.5 s queue timeout, which nothing asserts on.
"""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
from fakes import AUTH, WAIT_S, FakeScorer, row, scrape, settings
from falcon import testing
from runtime_fixtures import Background, Clock, Factory, runtime, spec, wait_until

from semif_serve.engine.engine import Engine
from semif_serve.errors import ClientGone, InvalidRequest, QueueTimedOut, ServerBusy, same_failure
from semif_serve.http import create_app
from semif_serve.http.errors import classify
from semif_serve.http.resources import patience_of
from semif_serve.runtime.admission import InFlightLimit
from semif_serve.runtime.device import DeviceQueue
from semif_serve.runtime.jobs import Waiter
from semif_serve.runtime.pace import WINDOW_CALLS, Pace, Rate, retry_after_s
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.scheduler import ModelScheduler
from semif_serve.runtime.service import DecisionService, _routing
from semif_serve.runtime.waiting import NEVER, WaiterGone, WouldTimeOut, deadline_after
from semif_serve.scoring.inputs import Batched

# The timeout of a lease that finds its slot free (it never waits): it only bounds the test's
# hang if the scheduler breaks. Longer than any estimate here, so never refused for it.
HOLD_S = 30.0
NOUL = {"type": "noul", "instructions": "Is it open?"}
PREDICATE = {"type": "predicate", "instructions": "Is it open?"}


class QueueWatch:
    """Tells the test when a scheduler's queue holds `n` waiters: each waiter is in the queue
    before it first waits on the scheduler's condition, and says so then."""

    def __init__(self, entry):
        self._entry = entry
        self._seen = threading.Condition()
        real_wait = entry._cond.wait

        def wait(timeout=None):
            with self._seen:
                self._seen.notify_all()
            return real_wait(timeout)

        entry._cond.wait = wait

    def until(self, n):
        with self._seen:
            assert self._seen.wait_for(lambda: len(self._entry._queue) == n, WAIT_S), "not queued"


def watched(entry):
    return QueueWatch(entry)


def never_load(entry):
    raise AssertionError("the model is ready: nothing loads it")


def ready_scheduler(clock):
    entry = ModelScheduler(spec("a"), clock)
    entry.publish(object(), None)
    return entry, watched(entry)


@pytest.fixture
def leaving():
    """Set as the test ends: its waiters in other threads leave (a failed test never hangs)."""
    event = threading.Event()
    yield event
    event.set()


@contextmanager
def holding(entry, tokens, served=False):
    """The model's one slot, held by this thread (an engine call of `tokens` in progress)."""
    entry.lease(deadline_after(HOLD_S), never_load, tokens=tokens)
    entry.call_started(tokens, 1)  # as the runtime says, once the device is its own
    try:
        yield
    finally:
        entry.release(served)


def serve_one(entry, clock, tokens, seconds):
    """One served engine call of `tokens` that took `seconds` on the fake clock."""
    with holding(entry, tokens, served=True):
        clock.now += seconds


def lease_and_leave(entry, deadline, tokens, gone):
    """In a thread of its own: wait for a slot, then give it back at once (nothing served)."""

    def run():
        entry.lease(deadline, never_load, gone, tokens)
        entry.release()
        return True

    return Background(run)


def runtime_lease(rt, model="a", **lease):
    """In a thread of its own: the runtime's lease of `model`, ended as soon as it is held."""

    def run():
        with rt.lease(model, **lease):
            return True

    return Background(run)


# -- 1. Rate -----------------------------------------------------------------------------------


def test_a_rate_has_no_estimate_before_its_first_call_then_scales_with_tokens():
    rate = Rate()
    assert rate.seconds_for(100) is None
    assert rate.request_tokens() == 0.0
    rate.record(100, 2, 5.0)
    assert rate.seconds_for(100) == 5.0
    assert rate.seconds_for(40) == 2.0
    assert rate.seconds_for(0) == 0.0
    assert rate.request_tokens() == 50.0


@pytest.mark.parametrize("call", [(0, 1, 1.0), (10, 0, 1.0), (10, 1, 0.0), (10, 1, -1.0)])
def test_a_call_that_served_nothing_or_took_no_time_tells_nothing(call):
    rate = Rate()
    rate.record(*call)
    assert rate.seconds_for(10) is None
    rate.record(10, 1, 2.0)
    rate.record(*call)
    assert rate.seconds_for(10) == 2.0 and rate.request_tokens() == 10.0


def test_the_rate_forgets_calls_older_than_its_window():
    assert WINDOW_CALLS == 16
    rate = Rate()
    rate.record(100, 1, 100.0)  # one slow call, then fast ones
    for _ in range(WINDOW_CALLS - 1):
        rate.record(100, 1, 1.0)
    assert rate.seconds_for(100) == pytest.approx((100.0 + 15.0) / 16)  # still remembered
    rate.record(100, 1, 1.0)
    assert rate.seconds_for(100) == 1.0  # the slow call left the window


def test_request_tokens_is_the_mean_request_of_the_recent_calls():
    rate = Rate()
    rate.record(100, 4, 1.0)
    rate.record(50, 1, 1.0)
    assert rate.request_tokens() == 30.0


def test_a_request_not_encoded_yet_counts_as_the_mean_request_and_managers_count_nothing():
    clock = Clock()
    pace = Pace(clock)
    pace.rate.record(100, 2, 5.0)  # 0.05 s a token, 50 tokens a request
    queue = [
        SimpleNamespace(tokens=0, is_request=True),
        SimpleNamespace(tokens=10, is_request=True),
        SimpleNamespace(tokens=0, is_request=False),
    ]
    assert pace.ahead(queue, 1) == pytest.approx((50 + 10) * 0.05)


# -- 2. Retry-After ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("estimate", "told"),
    [(None, 1.0), (0.0, 1.0), (0.2, 1.0), (14.2, 14.2), (60.0, 60.0), (1e9, 60.0), (math.nan, 1.0)],
)
def test_retry_after_is_the_estimate_within_one_second_and_one_minute(estimate, told):
    assert retry_after_s(estimate) == told


@pytest.mark.parametrize(
    ("error", "status", "seconds", "ms"),
    [
        (ServerBusy("busy", retry_after_s=14.2), 429, "15", "14200"),
        (ServerBusy("busy"), 429, "1", "1000"),
        (QueueTimedOut("waited"), 503, "1", "1000"),
        (QueueTimedOut("waited", retry_after_s=75.0), 503, "60", "60000"),
        (QueueTimedOut("waited", retry_after_s=2.0), 503, "2", "2000"),
    ],
)
def test_an_overloaded_refusal_says_its_estimate_in_both_retry_headers(error, status, seconds, ms):
    got_status, _, message, headers = classify(error)
    assert (got_status, message) == (status, str(error))
    assert headers == {"Retry-After": seconds, "retry-after-ms": ms}


# -- 3. the scheduler: estimates, refusal at once, what is measured ----------------------------


def test_a_queued_requests_estimate_is_the_work_ahead_and_a_deadline_it_would_pass_is_refused(
    leaving,
):
    clock = Clock()
    entry, watch = ready_scheduler(clock)
    assert entry.estimated_wait() is None  # nothing measured: nothing is refused for it
    serve_one(entry, clock, tokens=100, seconds=5.0)  # 0.05 s a token
    assert entry.estimated_wait() == 0.0
    with holding(entry, tokens=40):  # runs 2 s, 1 s of it gone; not served: says nothing
        clock.now += 1.0
        assert entry.estimated_wait() == pytest.approx(1.0)
        patient = lease_and_leave(entry, NEVER, 200, leaving.is_set)
        watch.until(1)
        assert entry._queue[0].estimate_s == pytest.approx(1.0)  # the running call's remainder
        assert entry.estimated_wait() == pytest.approx(200 * 0.05 + 1.0)
        assert entry.status()["queue"]["estimated_wait_s"] == pytest.approx(11.0)
        for timeout in (5.0, 10.9):  # 11 s ahead (its own 1 s of scoring is not a wait)
            with pytest.raises(WouldTimeOut) as refused:
                entry.lease(deadline_after(timeout), never_load, tokens=20)
            assert refused.value.ahead_s == pytest.approx(11.0)
            assert entry.status()["queued_requests"] == 1  # refused before it queued
        long = lease_and_leave(entry, deadline_after(60.0), 20, leaving.is_set)
        watch.until(2)
        endless = lease_and_leave(entry, NEVER, 20, leaving.is_set)
        watch.until(3)
        assert entry.status()["active_slots"] == 1
    assert [waiter.result() for waiter in (patient, long, endless)] == [True] * 3
    assert entry.pace.rate.seconds_for(100) == 5.0  # only the served call counted
    assert entry.status()["queue"]["estimated_wait_s"] == 0.0


def test_waits_and_their_estimates_are_counted_as_they_end(leaving):
    clock = Clock()
    entry, watch = ready_scheduler(clock)
    serve_one(entry, clock, tokens=100, seconds=5.0)  # waited 0 s, with no estimate yet
    with holding(entry, tokens=40):  # estimated 0 s, waited 0 s
        waiter = lease_and_leave(entry, NEVER, 200, leaving.is_set)  # estimated 2 s
        watch.until(1)
        clock.now += 3.0  # before the slot frees: it waited 3 s on the clock
    assert waiter.result()
    queue = entry.status()["queue"]
    assert {name: value for name, value in queue.items() if name != "estimated_wait_s"} == {
        "waits": 3,
        "waited_s": pytest.approx(3.0),
        "estimated_waits": 2,
        "estimated_s": pytest.approx(2.0),
        "estimated_waited_s": pytest.approx(3.0),
        "abandoned_queued": 0,
        "abandoned_scoring": 0,
    }


# -- 4. the runtime: 429 with the estimate, 503 with the estimate, abandonment ------------------


def measured_runtime(*specs, seconds=5.0):
    """A runtime on a fake clock whose models each served one call of 100 tokens in `seconds`."""
    clock = Clock()
    specs = specs or (spec("a", load_on_startup=True),)
    rt = runtime(*specs, clock=clock)
    for model in specs:
        with rt.lease(model.id, HOLD_S, tokens=100):
            clock.now += seconds
    return rt, clock


def test_a_request_whose_timeout_the_queue_would_pass_is_a_429_that_says_the_wait(leaving):
    rt, _ = measured_runtime()
    watch = watched(rt.entry("a"))
    with rt.lease("a", HOLD_S, tokens=40):  # 2 s left of it
        patient = runtime_lease(rt, gone=leaving.is_set, tokens=200)
        watch.until(1)
        assert rt.estimated_wait() == 12.0
        with pytest.raises(ServerBusy) as busy:
            with rt.lease("a", timeout_s=5.0, tokens=20):
                raise AssertionError("refused requests never get the engine")
        assert busy.value.retry_after_s == 12.0
        assert str(busy.value) == (
            "the model's queue holds about 12.0 s of work, more than this request's timeout "
            "of 5 s allows it to wait"
        )
        status, code, _, headers = classify(busy.value)
        assert (status, code) == (429, "busy")
        assert headers == {"Retry-After": "12", "retry-after-ms": "12000"}
        assert rt.entry("a").status()["queued_requests"] == 1
    assert patient.result()  # served once the hold ended


def test_a_queue_timeout_is_a_503_that_carries_the_models_estimate():
    rt, clock = measured_runtime(seconds=0.1)  # 0.001 s a token
    with rt.lease("a", HOLD_S, tokens=100):  # 0.1 s of work ahead: a 0.5 s timeout is admitted
        with pytest.raises(QueueTimedOut) as timed_out:
            with rt.lease("a", timeout_s=0.5, tokens=1):
                raise AssertionError("the slot is held until the timeout")
    assert timed_out.value.retry_after_s == pytest.approx(0.1)
    assert classify(timed_out.value)[0] == 503
    assert classify(timed_out.value)[3] == {"Retry-After": "1", "retry-after-ms": "1000"}


def test_a_waiter_whose_client_leaves_is_counted_abandoned_in_the_queue():
    rt, _ = measured_runtime()
    watch = watched(rt.entry("a"))
    left = threading.Event()
    with rt.lease("a", HOLD_S, tokens=40):
        waiting = runtime_lease(rt, gone=left.is_set, tokens=20)
        watch.until(1)
        left.set()
        with pytest.raises(ClientGone):
            waiting.result()
    queue = rt.status()[0]["queue"]
    assert (queue["abandoned_queued"], queue["abandoned_scoring"]) == (1, 0)
    assert rt.entry("a").status()["queued_requests"] == 0


def test_the_runtimes_estimate_sums_its_models():
    specs = (spec("a", load_on_startup=True), spec("b", load_on_startup=True))
    assert runtime(*specs, clock=Clock()).estimated_wait() is None  # nothing measured
    rt, _ = measured_runtime(*specs)  # both at 0.05 s a token
    with rt.lease("a", HOLD_S, tokens=40), rt.lease("b", HOLD_S, tokens=10):
        assert rt.estimated_wait() == pytest.approx(2.0 + 0.5)


# -- 5. a failure handed to another thread keeps its estimate -----------------------------------


@pytest.mark.parametrize(
    "error", [ServerBusy("full", retry_after_s=3.5), QueueTimedOut("late", 7.0)]
)
def test_same_failure_keeps_retry_after(error):
    copy = same_failure(error)
    assert copy is not error and type(copy) is type(error)
    assert (str(copy), copy.retry_after_s) == (str(error), error.retry_after_s)


# -- 6. HTTP: the client's announced patience, the in-flight 429, /metrics -----------------------


@pytest.mark.parametrize(
    ("value", "patience"),
    [
        ("10", 10.0),
        ("600.0", 600.0),
        (" 2.5 ", 2.5),
        ("0", None),
        ("0.0", None),
        ("abc", None),
        ("1e400", None),
        ("-1", None),
        ("9" * 400, None),
        ("nan", None),
        ("inf", None),
        ("1.", None),
        ("", None),
        (None, None),
    ],
)
def test_patience_is_the_announced_read_timeout_or_nothing(value, patience):
    headers = {} if value is None else {"x-stainless-read-timeout": value}
    assert patience_of(testing.create_req(headers=headers)) == patience


def served_app(limit=None):
    """The app over a measured runtime (0.05 s a token) on a fake clock."""
    config = settings(parallel_slots=4)
    rt, _ = measured_runtime()
    return testing.TestClient(create_app(DecisionService(rt, config), config, limit)), rt


def test_the_in_flight_limits_429_says_the_runtimes_estimate():
    limit = InFlightLimit(1)
    api, rt = served_app(limit)
    with rt.lease("a", HOLD_S, tokens=50):  # 2.5 s of work in progress
        limit.acquire()  # one request in progress: the next is refused at the door
        try:
            response = api.simulate_post("/decide", json=row(), headers=AUTH)
        finally:
            limit.release()
    assert response.status_code == 429
    assert response.json["error"]["code"] == "busy"
    assert response.headers["Retry-After"] == "3"
    assert response.headers["retry-after-ms"] == "2500"


ROUTES = {
    "/decide": row(),
    "/decide/shared": {
        "state": "The door is open.",
        "decisions": [{key: row()[key] for key in ("id", "question", "options")}],
    },
    "/v1/systemone": {
        "state": "The door is open.",
        "questions": {"q": {"type": "noul", "instructions": "Is it open?"}},
    },
    "/v1/decisions": {
        "input": "The door is open.",
        "questions": [{"type": "predicate", "instructions": "Is it open?"}],
    },
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_a_client_whose_announced_timeout_the_queue_would_pass_is_refused_at_once(route):
    api, rt = served_app()
    watch = watched(rt.entry("a"))
    scorer = rt.entry("a").engine.scorer
    body = ROUTES[route]
    with rt.lease("a", HOLD_S, tokens=50):  # 2.5 s of work in progress
        hurried = {**AUTH, "x-stainless-read-timeout": "1"}
        response = Background(lambda: api.simulate_post(route, json=body, headers=hurried))
        response = response.result()  # refused at once: it never waits for the held slot
        assert response.status_code == 429
        assert (response.headers["Retry-After"], response.headers["retry-after-ms"]) == (
            "3",
            "2500",
        )
        assert scorer.calls == []
        patient = {**AUTH, "x-stainless-read-timeout": "600.0"}
        queued = Background(lambda: api.simulate_post(route, json=body, headers=patient))
        watch.until(1)
    assert queued.result().status_code == 200


def test_metrics_export_each_models_queue_figures_and_estimate(leaving):
    config = settings(parallel_slots=4)
    clock = Clock()
    rt = runtime(spec("a", load_on_startup=True), clock=clock)
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    model = (("model", "a"),)
    assert ("semif_queue_estimate_seconds", model) not in scrape(api)  # nothing measured
    with rt.lease("a", HOLD_S, tokens=100):
        clock.now += 5.0
    watch = watched(rt.entry("a"))
    with rt.lease("a", HOLD_S, tokens=40):  # 2 s of work, then 10 s queued behind it
        waiter = runtime_lease(rt, gone=leaving.is_set, tokens=200)
        watch.until(1)
        assert scrape(api)[("semif_queue_estimate_seconds", model)] == 12.0
        clock.now += 3.0
    assert waiter.result()
    samples = scrape(api)
    assert samples[("semif_queue_estimate_seconds", model)] == 0.0
    assert samples[("semif_queue_waits_total", model)] == 3
    assert samples[("semif_queue_wait_seconds_total", model)] == 3.0
    assert samples[("semif_queue_estimated_waits_total", model)] == 2
    assert samples[("semif_queue_estimated_wait_seconds_total", model)] == 2.0
    assert samples[("semif_queue_estimated_waited_seconds_total", model)] == 3.0
    abandoned = {
        stage: ("semif_model_requests_abandoned_total", (*model, ("stage", stage)))
        for stage in ("queued", "scoring")
    }
    assert [samples[key] for key in abandoned.values()] == [0, 0]
    rt.entry("a").count_abandoned("scoring", 3)
    assert scrape(api)[abandoned["scoring"]] == 3


# -- a shared device (no SEMIF_PARALLEL_SLOTS, the default) ------------------------------------


def shared_device_runtime():
    """Models a and b sharing one device (`DeviceQueue`), on a fake clock."""
    clock = Clock()
    specs = [spec("a", load_on_startup=True), spec("b", load_on_startup=True)]
    rt = Runtime(settings(), Factory(), specs, "a", clock, device=DeviceQueue())
    Background(lambda: rt.start(idle_interval_s=None)).result()
    return rt, clock


def asking(asked, answer):
    """A `gone` check that says it was asked (b waits for the device: nothing else waits)."""

    def gone():
        asked.set()
        return answer.is_set()

    return gone


def test_a_client_that_leaves_while_waiting_for_the_device_is_counted_abandoned():
    rt, _ = shared_device_runtime()
    asked, left = threading.Event(), threading.Event()
    with rt.lease("a", HOLD_S, tokens=100):  # a's call holds the device
        waiting = runtime_lease(rt, "b", gone=asking(asked, left), tokens=1)
        assert asked.wait(WAIT_S)
        left.set()
        with pytest.raises(ClientGone):
            waiting.result()
    assert rt.entry("b").status()["queue"]["abandoned_queued"] == 1


def test_a_models_pace_does_not_count_its_wait_for_another_models_call(leaving):
    rt, clock = shared_device_runtime()
    asked = threading.Event()

    def b_call():
        with rt.lease("b", HOLD_S, asking(asked, leaving), tokens=100):
            clock.now += 1.0  # b's own call: 1 s

    with rt.lease("a", HOLD_S, tokens=100):
        b = Background(b_call)
        assert asked.wait(WAIT_S)
        clock.now += 10.0  # a's call runs 10 s while b waits for the device
    b.result()
    assert rt.entry("b").pace.rate.seconds_for(100) == 1.0  # measured: 11.0


# -- the request's deadline: its timeout_s and its client's announced patience ------------------


@pytest.mark.parametrize(
    ("body", "patience", "route"),
    [
        ({}, None, (None, None, 7.0)),
        ({"timeout_s": 3}, None, (None, 3.0, 7.0)),
        ({}, 2.5, (None, 2.5, 7.0)),
        ({"timeout_s": 5, "model": "m"}, 2.0, ("m", 2.0, 7.0)),  # the shorter of the two
        ({"timeout_s": 1}, 2.0, (None, 1.0, 7.0)),
        ({"timeout_s": 86_400}, None, (None, 86_400.0, 7.0)),
    ],
)
def test_a_requests_deadline_is_the_shorter_of_its_timeout_and_its_clients_patience(
    body, patience, route
):
    assert _routing(body, patience, 7.0) == route  # 7.0: when the request arrived
    assert all(isinstance(value, float) for value in _routing(body, patience, 7.0)[1:] if value)


@pytest.mark.parametrize(
    "body",
    [
        {"timeout_s": 0},
        {"timeout_s": -1},
        {"timeout_s": 86_401},
        {"timeout_s": 10**400},
        {"timeout_s": True},
        {"timeout_s": "5"},
        {"model": 7},
    ],
)
def test_a_bad_timeout_or_model_is_refused_whatever_the_patience(body):
    with pytest.raises(InvalidRequest) as refused:
        _routing(body, 2.0, None)
    field = "model" if "model" in body else "timeout_s"
    expected = {
        "model": "model: must be a model name string",
        "timeout_s": "timeout_s: must be a number of seconds, 0 < timeout_s <= 86400",
    }
    assert str(refused.value) == expected[field]


@pytest.mark.parametrize("batched", [False, True])
def test_a_served_request_is_timed_into_the_pace_with_the_tokens_it_was_encoded_to(batched):
    """Through the service: the request's work is its encoded prompt's tokens (7 here), whether
    it leases the model (batching off) or runs in a batch."""
    clock = Clock()

    class Encoding(FakeScorer):
        def prepare(self, row):
            return SimpleNamespace(prompt=SimpleNamespace(ids=[0] * 7), row=row)

        def score(self, item):
            clock.now += 2.0
            return super().score(item.row)

        def score_batch(self, items, left=None):
            clock.now += 2.0
            return [Batched(self.result(item.row), len(items), 7) for item in items]

    config = settings(parallel_slots=4, max_batch_rows=4 if batched else 1)
    rt = runtime(
        spec("a", load_on_startup=True),
        factory=lambda model: Engine(Encoding()),
        clock=clock,
        max_batch_rows=config.max_batch_rows,
    )
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200
    wait_until(lambda: rt.entry("a")._active == 0)  # a batch is timed once it has replied
    rate = rt.entry("a").pace.rate
    assert (rate.seconds_for(7), rate.request_tokens()) == (2.0, 7.0)


def test_an_idle_model_refuses_no_one_however_slow_its_recent_calls_were():
    clock = Clock()
    entry, _ = ready_scheduler(clock)
    serve_one(entry, clock, tokens=10, seconds=500.0)  # a very slow call
    entry.lease(deadline_after(1.0), never_load, tokens=10_000)  # admitted: nothing ahead
    entry.release()
    queue = entry.status()["queue"]
    assert (queue["waits"], queue["estimated_waits"], queue["estimated_s"]) == (2, 1, 0.0)


def test_with_nothing_ahead_even_the_shortest_timeout_is_admitted():
    """A deadline bounds waits: a request that need not wait is never refused for it (5e-324 s:
    schemathesis's smallest positive `timeout_s`)."""
    clock = Clock()
    entry, _ = ready_scheduler(clock)
    serve_one(entry, clock, tokens=10, seconds=1.0)
    assert entry.estimated_wait() == 0.0
    entry.lease(deadline_after(5e-324), never_load, tokens=10)
    entry.release()


def test_with_several_slots_the_queue_drains_on_all_of_them_and_the_longest_call_counts(
    leaving,
):
    clock = Clock()
    entry = ModelScheduler(spec("a", slots=2), clock)
    entry.publish(object(), None)
    serve_one(entry, clock, tokens=100, seconds=5.0)  # 0.05 s a token
    running = [(100, 1, clock.now), (40, 1, clock.now)]  # 5 s and 2 s of work, just started
    entry.pace._running = dict(enumerate(running))
    queued = [Waiter(tokens=200)]  # 10 s of work on 2 slots
    assert entry.pace.ahead(queued, slots=2) == pytest.approx(10.0 / 2 + 5.0)
    assert entry.pace.ahead(queued, 1) == pytest.approx(10.0 + 5.0)
    entry._active = 2  # the two calls running hold both slots: the request stays queued
    entry._queue.append(queued[0])  # the scheduler counts its own slots
    assert entry.estimated_wait() == pytest.approx(10.0)
    assert entry.status()["queue"]["estimated_wait_s"] == pytest.approx(10.0)
    with pytest.raises(WouldTimeOut):  # 10 s ahead on 2 slots: a 9 s deadline is refused...
        entry.lease(deadline_after(9.0), never_load, tokens=10)
    watch = watched(entry)
    admitted = lease_and_leave(entry, deadline_after(12.0), 10, leaving.is_set)
    watch.until(2)  # ...a 12 s one queues (15 s on one slot would be refused)
    leaving.set()
    with pytest.raises(WaiterGone):
        admitted.result()
    with entry._cond:  # the request put in the queue by hand leaves it
        entry._queue.clear()


def test_a_leased_request_whose_caller_left_while_it_was_scored_is_counted():
    rt, _ = measured_runtime()
    gone = threading.Event()
    with rt.lease("a", HOLD_S, gone=gone.is_set, tokens=10):
        gone.set()  # the caller leaves while its call runs
    with rt.lease("a", HOLD_S, gone=lambda: False, tokens=10):
        pass
    queue = rt.entry("a").status()["queue"]
    assert (queue["abandoned_scoring"], queue["abandoned_queued"]) == (1, 0)


def test_a_call_released_without_saying_it_was_served_counts_nothing():
    clock = Clock()
    entry, _ = ready_scheduler(clock)
    serve_one(entry, clock, tokens=10, seconds=1.0)
    entry.lease(deadline_after(HOLD_S), never_load)
    entry.call_started(10, 1)
    clock.now += 50.0
    entry.release()  # not said to be served: a failed or dropped call
    assert entry.pace.rate.seconds_for(10) == 1.0


def test_a_lease_of_unknown_size_counts_as_the_mean_request(leaving):
    clock = Clock()
    entry, watch = ready_scheduler(clock)
    serve_one(entry, clock, tokens=100, seconds=5.0)  # the mean request: 100 tokens, 5 s
    with holding(entry, tokens=0):  # its own size unknown too: the mean's 5 s, just started
        unknown = Background(lambda: entry.lease(NEVER, never_load, leaving.is_set))
        watch.until(1)
        assert entry.estimated_wait() == pytest.approx(5.0 + 5.0)
        leaving.set()
        with pytest.raises(WaiterGone):
            unknown.result()


def test_two_small_waits_and_their_estimates_add_up():
    clock = Clock()
    entry, watch = ready_scheduler(clock)
    serve_one(entry, clock, tokens=100, seconds=5.0)  # 0.05 s a token
    for waited in (1.0, 2.0):
        with holding(entry, tokens=40):  # 2 s of work ahead of the next
            waiter = lease_and_leave(entry, NEVER, 20, lambda: False)
            watch.until(1)
            clock.now += waited
        assert waiter.result()
    queue = entry.status()["queue"]
    assert (queue["waited_s"], queue["estimated_s"], queue["estimated_waited_s"]) == (
        pytest.approx(3.0),
        pytest.approx(4.0),
        pytest.approx(3.0),
    )


def test_a_refusal_for_less_than_a_second_of_work_ahead():
    clock = Clock()
    entry, _ = ready_scheduler(clock)
    serve_one(entry, clock, tokens=100, seconds=5.0)
    with holding(entry, tokens=10):  # 0.5 s of work ahead
        with pytest.raises(WouldTimeOut):
            entry.lease(deadline_after(0.3), never_load, tokens=10)


def test_the_wait_a_refusal_says_is_the_models_or_every_models_on_a_shared_device():
    alone = runtime(spec("a"), spec("b"))
    assert alone._wait_for(alone.entry("a")) == alone.entry("a").estimated_wait
    shared, _ = shared_device_runtime()
    assert shared._wait_for(shared.entry("a")) == shared.estimated_wait


def test_an_in_flight_limit_without_an_estimate_says_none():
    limit = InFlightLimit(1)
    limit.acquire()
    with pytest.raises(ServerBusy) as busy:
        limit.acquire()
    assert busy.value.retry_after_s is None


def test_a_request_of_unknown_size_before_any_mean_counts_nothing():
    """A request that found its model unloaded is encoded only once it holds it: its size is
    unknown as it queues, and with no mean request yet its call tells the pace nothing."""
    clock = Clock()

    class Timed(FakeScorer):
        def score(self, row):
            clock.now += 2.0
            return super().score(row)

    config = settings(parallel_slots=4, max_batch_rows=1)
    rt = runtime(
        spec("a"),
        factory=lambda model: Engine(Timed()),
        clock=clock,
        max_batch_rows=1,
    )
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    assert api.simulate_post("/decide", json=row(), headers=AUTH).status_code == 200
    assert rt.entry("a").pace.rate.seconds_for(1) is None


def test_the_queue_figures_count_in_integers_and_time_in_seconds():
    figures = ModelScheduler(spec("a"), Clock()).status()["queue"]
    counts = {name: value for name, value in figures.items() if not name.endswith("_s")}
    seconds = {name: value for name, value in figures.items() if name.endswith("_s")}
    assert all(type(value) is int for value in counts.values()), counts
    assert seconds.pop("estimated_wait_s") is None
    assert all(type(value) is float for value in seconds.values()), seconds


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/systemone", {"state": "s", "questions": {f"q{k}": NOUL for k in range(3)}}),
        ("/v1/decisions", {"input": "s", "questions": [PREDICATE] * 3}),
    ],
)
@pytest.mark.parametrize("rows", [1, 4])  # each call alone (a lease), or batched (a job)
def test_a_request_of_several_calls_waits_within_one_deadline(path, body, rows):
    """Issue 40, defect 9: each call of a request over SEMIF_MAX_DECISIONS questions had a
    deadline of its own, from when it queued: a 400-question request could wait ~7x its
    timeout. Now every call's deadline is the one counted from the request's arrival."""
    config = settings(max_decisions=1, max_batch_rows=rows)
    rt = Runtime(config, lambda spec: Engine(FakeScorer()), [spec("a")], "a")
    deadlines = []
    own = rt.deadline
    rt.deadline = lambda *args: deadlines.append(own(*args)) or deadlines[-1]
    app = create_app(DecisionService(rt, config), config)
    client = testing.TestClient(app)
    response = client.simulate_post(path, json={**body, "timeout_s": 5}, headers=AUTH)
    assert response.status_code == 200, response.text
    assert len(deadlines) == 3 and len({deadline.at for deadline in deadlines}) == 1
    assert deadlines[0].timeout_s == 5
