"""One configuration per request (issue 43, finding 6): an ecosystem request of several engine
calls (more questions than SEMIF_MAX_DECISIONS) is answered by the model configuration its first
call ran under, or fails whole with 503 `configuration_changed`: a `PUT` between two of its calls
never gives one reply mixing float32 and bfloat16 answers, nor a 422 after rows were scored."""

from __future__ import annotations

from dataclasses import replace

import pytest
from fakes import AUTH, WAIT_S, decision, settings
from falcon import testing
from runtime_fixtures import Background, Factory, spec, wait_until

from semif_serve.errors import ConfigurationChanged, InvalidRequest
from semif_serve.http import create_app
from semif_serve.runtime.jobs import Job, pinned_to
from semif_serve.runtime.pinning import Pinned
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.selection import Cost
from semif_serve.runtime.service import DecisionService
from semif_serve.scoring.rows import RowError

ADMIN = "a" * 40
ADMIN_AUTH = {"Authorization": f"Bearer {ADMIN}"}
PER_CALL = 2  # SEMIF_MAX_DECISIONS: three questions are two calls, of two and one
QUESTIONS = [{"type": "predicate", "instructions": f"Is it {word}?"} for word in "abc"]
BODY = {"input": "The door is open.", "questions": QUESTIONS}
SERVED = {"source": "test:a", "device": "cpu", "slots": 2}  # model a as the server registered it


def server(max_batch_rows: int):
    config = settings(
        admin_token=ADMIN, parallel_slots=2, max_decisions=PER_CALL, max_batch_rows=max_batch_rows
    )
    factory = Factory()
    rt = Runtime(config, factory, [spec("a", slots=2, load_on_startup=True)], "a")
    Background(lambda: rt.start(idle_interval_s=None)).result()
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    return api, rt, factory


def between_the_calls(api, rt, factory, change):
    """POST BODY to /v1/decisions and run `change(api)` after its first call has scored and
    before its second starts: the first call is held in the scorer until `change`'s manager
    has queued behind it (the request's second call then queues behind the manager)."""
    scorer = factory.engines["a"].scorer
    scorer.entered.clear()
    scorer.release.clear()
    call = Background(lambda: api.simulate_post("/v1/decisions", json=BODY, headers=AUTH))
    assert scorer.entered.wait(WAIT_S), "the request's first call never ran"
    changed = Background(lambda: change(api))
    wait_until(lambda: any(not waiter.is_request for waiter in rt.entry("a")._queue))
    scorer.release.set()
    return call.result(), changed.result()


def put(api, table):
    return api.simulate_put("/v1/models/a", json={**SERVED, **table}, headers=ADMIN_AUTH)


def rows_scored(scorer):
    return sum(len(rows) if kind == "score_shared" else 1 for kind, rows in scorer.calls)


BATCHING = pytest.mark.parametrize("max_batch_rows", [1, 4], ids=["leased", "batched"])


@BATCHING
@pytest.mark.parametrize(
    "change", [{"dtype": "bfloat16"}, {"max_tokens": 1024}, {"source": "test:a2"}]
)
def test_a_put_that_changes_the_configuration_between_two_calls_fails_the_request_whole(
    max_batch_rows, change
):
    """Before: the reply mixed the two configurations' answers (dtype), or the request was
    refused after its first rows were scored (max_tokens)."""
    api, rt, factory = server(max_batch_rows)
    first = factory.engines["a"]
    reply, changed = between_the_calls(api, rt, factory, lambda api: put(api, change))
    assert changed.status_code == 200, changed.json
    assert reply.status_code == 503, reply.json
    assert reply.json["error"]["code"] == "configuration_changed"
    assert reply.json["error"]["message"].startswith(
        "model 'a' was reconfigured while this request was being scored in several calls"
    )
    assert reply.headers["retry-after"] == "1"
    assert "answers" not in reply.json
    assert rows_scored(first.scorer) == PER_CALL  # its first call only
    reconfigured = factory.engines["a"]
    if reconfigured is not first:
        assert reconfigured.scorer.calls == []  # the second call never ran
    again = api.simulate_post("/v1/decisions", json=BODY, headers=AUTH)  # the retry
    assert again.status_code == 200 and len(again.json["answers"]) == len(QUESTIONS)


@BATCHING
def test_a_put_that_keeps_the_configuration_keeps_the_request(max_batch_rows):
    """keep_alive_s and slots change no answer: the request is answered whole."""
    api, rt, factory = server(max_batch_rows)
    reply, changed = between_the_calls(
        api, rt, factory, lambda api: put(api, {"keep_alive_s": 600, "slots": 1})
    )
    assert changed.status_code == 200, changed.json
    assert reply.status_code == 200, reply.json
    assert len(reply.json["answers"]) == len(QUESTIONS)


@BATCHING
def test_a_reload_of_the_same_configuration_keeps_the_request(max_batch_rows):
    """An unload between two calls: the second loads the same configuration again and scores."""
    api, rt, factory = server(max_batch_rows)
    first = factory.engines["a"]
    reply, unloaded = between_the_calls(
        api, rt, factory, lambda api: api.simulate_post("/v1/models/a/unload", headers=ADMIN_AUTH)
    )
    assert unloaded.status_code == 200, unloaded.json
    assert reply.status_code == 200, reply.json
    assert len(reply.json["answers"]) == len(QUESTIONS)
    assert factory.engines["a"] is not first  # loaded again, for the second call
    assert rows_scored(factory.engines["a"].scorer) == len(QUESTIONS) - PER_CALL


def test_a_pin_holds_the_first_configuration_it_is_shown():
    pinned = Pinned()
    served = spec("a")
    pinned.check(served)
    pinned.check(served)
    for changed in [
        spec("a", source="test:b"),
        *(
            replace(served, **{name: value})
            for name, value in [
                ("revision", "r2"),
                ("dtype", "bfloat16"),
                ("device", "cuda"),
                ("max_tokens", 1024),
            ]
        ),
    ]:
        with pytest.raises(ConfigurationChanged, match="^model 'a' was reconfigured"):
            pinned.check(changed)
    pinned.check(replace(served, slots=4, keep_alive_s=5.0, load_on_startup=True))


class Limited(Factory):
    """Engines whose encoding refuses a row longer (in characters) than the spec's max_tokens,
    as a real one refuses a prompt over SEMIF_MAX_TOKENS."""

    def __call__(self, model_spec):
        engine = super().__call__(model_spec)

        def prepare_shared(rows):
            for index, one in enumerate(rows):
                if len(one.question) > model_spec.max_tokens:
                    raise RowError(f"rows[{index}]: over {model_spec.max_tokens} tokens", index)
            return rows

        engine.scorer.prepare_shared = prepare_shared
        return engine


def no_check(model_spec):
    return None


def call_after_a_first(max_batch_rows, question_length, change):
    """A /decide/shared call of a request whose first call ran under model a as registered
    (max_tokens 4096), after `change` was applied: the outcome's error, or None."""
    config = settings(admin_token=ADMIN, parallel_slots=2, max_batch_rows=max_batch_rows)
    rt = Runtime(
        config, Limited(), [spec("a", slots=2, load_on_startup=True)], "a", source_check=no_check
    )
    Background(lambda: rt.start(idle_interval_s=None)).result()
    service = DecisionService(rt, config)
    pinned = Pinned()
    pinned.check(rt.entry("a").spec)  # as its first call did
    rt.register("a", {**SERVED, **change})
    body = {"state": "s", "decisions": [{**decision("d"), "question": "q" * question_length}]}
    try:
        service.decide_shared(body, pinned=pinned)
    except Exception as error:  # noqa: BLE001 - the test reads it
        return error
    return None


@BATCHING
def test_a_later_call_refused_by_limits_set_since_the_first_is_503_never_422(max_batch_rows):
    """Before: a PUT max_tokens between two calls refused the request (422) after its first
    rows were scored: limits it never started under."""
    error = call_after_a_first(max_batch_rows, 2000, {"max_tokens": 1024})
    assert isinstance(error, ConfigurationChanged), error


@BATCHING
def test_a_later_call_over_the_pinned_limits_is_the_callers_422(max_batch_rows):
    error = call_after_a_first(max_batch_rows, 5000, {"keep_alive_s": 60})
    assert isinstance(error, InvalidRequest) and "over 4096 tokens" in str(error), error
    assert call_after_a_first(max_batch_rows, 2000, {"keep_alive_s": 60}) is None


def test_a_batch_runs_every_job_but_those_pinned_to_another_configuration():
    served, other = spec("a"), replace(spec("a"), dtype="bfloat16")

    def job(pin_to):
        pinned = None
        if pin_to is not None:
            pinned = Pinned()
            pinned.check(pin_to)
        return Job(item=None, cost=Cost(1, 1), engine=None, prepare=lambda e: None, pinned=pinned)

    changed, kept, unpinned, changed_too = job(other), job(served), job(None), job(other)
    assert pinned_to(served, [changed, kept, unpinned, changed_too]) == [kept, unpinned]
    for dropped in (changed, changed_too):
        assert dropped.done.is_set() and isinstance(dropped.outcome, ConfigurationChanged)
        assert str(dropped.outcome) == (
            "model 'a' was reconfigured while this request was being scored in several calls; "
            "it was failed whole, before any answer, rather than answered by two "
            "configurations: retry it"
        )
    assert not kept.done.is_set() and not unpinned.done.is_set()
