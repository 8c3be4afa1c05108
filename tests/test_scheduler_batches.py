"""Issue 23: the dynamic batcher in the runtime (fake engines; every wait bounded).

Requests queued while the model is busy are scored together, oldest first; a request another
leader took leaves the queue at once; limits hold (rows, padded tokens; an oversize request
alone); no request barges past a manager; a queued request's timeout and a caller who leaves
end its wait unscored; a batch that runs out of memory is split until only what cannot fit
alone fails; the replies say the batch they ran in.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from fakes import AUTH, WAIT_S, FakeScorer, decision, fake_runtime, row, settings
from falcon import testing
from runtime_fixtures import Clock, Held, runtime, spec, wait_until, watch_waits

from semif_serve.engine.engine import Engine
from semif_serve.errors import ClientGone, OutOfMemory, QueueTimedOut, ScoringFailed
from semif_serve.http import create_app
from semif_serve.http.environ import CLIENT_GONE_KEY
from semif_serve.runtime.jobs import Job, forwards
from semif_serve.runtime.registry import Runtime
from semif_serve.runtime.selection import Cost, cost_of, gather_ends
from semif_serve.runtime.service import DecisionService
from semif_serve.runtime.waiting import NEVER, Deadline
from semif_serve.scoring import PromptRejected, parse_row
from semif_serve.scoring.inputs import Batched, Forward

BATCHING = {"max_batch_rows": 4, "max_batch_tokens": 1000}


class BatchScorer(FakeScorer):
    """Records each batch's item ids; `failing`: ids whose batch runs out of memory."""

    def __init__(self, block=False, failing=()):
        super().__init__(block=block)
        self.batches: list[list[str]] = []
        self.failing = set(failing)

    def score_batch(self, items, left=None):
        ids = [item[0].id if isinstance(item, list) else item.id for item in items]
        self.batches.append(ids)
        self._enter()
        if self.failing & set(ids):
            raise OutOfMemory("CUDA out of memory (fake)")
        # What ran, as a real scorer tells it: one forward of every row, 7 wide, 5 real each.
        forward = Forward(len(items), 7 * len(items), 5 * len(items))
        return [Batched(self._outcome(item), len(items), 7, forward) for item in items]

    def _outcome(self, item):
        if isinstance(item, list):  # a shared call's rows
            return [self.result(one) for one in item], {"batch_size": len(item)}
        return self.result(item)


class Engines:
    """A factory whose engines drive one BatchScorer."""

    def __init__(self, scorer):
        self.scorer = scorer

    def __call__(self, model_spec):
        return Engine(self.scorer, concurrency=model_spec.slots)


def batching_runtime(scorer, **overrides):
    return runtime(
        spec("a", load_on_startup=True), factory=Engines(scorer), **{**BATCHING, **overrides}
    )


class Submitted:
    """One request through the batcher, in its own thread; `prepare` (default: the row as it
    is) encodes it for an engine other than the one loaded when it was sent."""

    def __init__(
        self, rt, name, rows=1, length=1, timeout_s=None, gone=None, model="a", prepare=None
    ):
        item = parse_row(row(id=name))
        self.job = Job(
            item=item,
            cost=Cost(rows, length),
            engine=rt.entry(model).engine if prepare is None else None,
            prepare=prepare or (lambda engine: item),
            gone=gone,
        )
        self.outcome = self.error = None
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(rt, model, timeout_s))
        self.thread.start()

    def _run(self, rt, model, timeout_s):
        try:
            self.outcome = rt.score_batched(model, timeout_s, self.job)
        except BaseException as error:  # reported to the test
            self.error = error
        finally:
            self.done.set()

    def result(self):
        assert self.done.wait(WAIT_S)
        self.thread.join(WAIT_S)
        return self.outcome


def queued_jobs(rt, model="a") -> int:
    return sum(1 for waiter in rt.entry(model)._queue if waiter.job is not None)


def jobs_queued(rt, count: int, model="a") -> None:
    wait_until(lambda: queued_jobs(rt, model) == count)


def batches_ended(rt, model="a") -> None:
    """Wait until no batch holds the model: each one's bookkeeping (the metrics, its pace) is
    done in its own thread once its requests have their outcomes."""
    wait_until(lambda: rt.entry(model)._active == 0)


def busy(rt, scorer) -> Submitted:
    """A first request that leads and is held inside the engine until `scorer.release`."""
    scorer.release.clear()
    scorer.entered.clear()
    first = Submitted(rt, "first")
    assert scorer.entered.wait(WAIT_S)
    return first


def test_requests_queued_while_the_model_is_busy_are_scored_together_oldest_first():
    scorer = BatchScorer()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    waiting = []
    for name in ["b", "c", "d"]:
        waiting.append(Submitted(rt, name))
        jobs_queued(rt, len(waiting))
    scorer.release.set()
    outcomes = [first.result()] + [request.result() for request in waiting]
    assert scorer.batches == [["first"], ["b", "c", "d"]]
    assert [outcome.outcome["id"] for outcome in outcomes] == ["first", "b", "c", "d"]
    assert rt.entry("a").status()["queued_requests"] == 0 and queued_jobs(rt) == 0
    batches_ended(rt)  # and the batch gave back its slot


def test_the_row_limit_splits_the_queue_in_arrival_order_and_an_oversize_request_runs_alone():
    scorer = BatchScorer()
    rt = batching_runtime(scorer, max_batch_rows=2)
    first = busy(rt, scorer)
    waiting = []
    for name, rows in [("b", 1), ("c", 1), ("d", 1), ("big", 3), ("e", 1)]:
        waiting.append(Submitted(rt, name, rows=rows))
        jobs_queued(rt, len(waiting))
    scorer.release.set()
    for request in [first, *waiting]:
        request.result()
    assert scorer.batches == [["first"], ["b", "c"], ["d"], ["big"], ["e"]]


def test_the_token_budget_counts_rows_times_the_longest_prompt():
    scorer = BatchScorer()
    rt = batching_runtime(scorer, max_batch_tokens=300)
    first = busy(rt, scorer)
    waiting = []
    for name, length in [("b", 100), ("c", 100), ("d", 150), ("e", 10)]:
        waiting.append(Submitted(rt, name, length=length))
        jobs_queued(rt, len(waiting))
    scorer.release.set()
    for request in [first, *waiting]:
        request.result()
    # b, c: 2 x 100; with d: 3 x 150 > 300; d, e: 2 x 150 = 300
    assert scorer.batches == [["first"], ["b", "c"], ["d", "e"]]


class BucketingScorer(BatchScorer):
    """Counts a forward's tokens as a CUDA model with shape buckets runs it: rows padded to a
    power of two (`TorchScorer.batch_tokens` over `shapes.bucketed_tokens`)."""

    def batch_tokens(self, rows, length):
        return (1 << (rows - 1).bit_length()) * length


def test_the_token_budget_counts_a_forward_as_the_model_runs_it_buckets_included():
    """Issue 30, finding 5: rows x longest fitted the budget while the bucketed forward did not
    (14 x 1,170 counted 16,380 tokens and ran 16 x 1,280)."""
    scorer = BucketingScorer()
    rt = batching_runtime(scorer, max_batch_tokens=1000, max_batch_rows=8)
    first = busy(rt, scorer)
    waiting = []
    for name in "bcd":
        waiting.append(Submitted(rt, name, length=300))
        jobs_queued(rt, len(waiting))
    scorer.release.set()
    for request in [first, *waiting]:
        request.result()
    # b, c, d: 3 x 300 = 900 tokens, but they run as 4 x 300 = 1,200: only b, c go together
    assert scorer.batches == [["first"], ["b", "c"], ["d"]]


def test_a_queued_request_past_its_timeout_leaves_unscored():
    scorer = BatchScorer()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    late = Submitted(rt, "late", timeout_s=0.05)
    assert late.done.wait(WAIT_S)
    assert isinstance(late.error, QueueTimedOut)
    assert queued_jobs(rt) == 0
    scorer.release.set()
    first.result()
    assert scorer.batches == [["first"]]


def test_a_caller_who_leaves_while_queued_is_never_scored():
    scorer = BatchScorer()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    left = threading.Event()
    leaving = Submitted(rt, "leaving", gone=left.is_set)
    staying = Submitted(rt, "staying")
    wait_until(lambda: queued_jobs(rt) == 2)
    left.set()
    assert leaving.done.wait(WAIT_S)
    assert isinstance(leaving.error, ClientGone)
    scorer.release.set()
    first.result()
    assert staying.result().outcome["id"] == "staying"
    assert scorer.batches == [["first"], ["staying"]]


def test_a_caller_gone_when_its_batch_runs_is_dropped_and_the_others_are_scored():
    scorer = BatchScorer()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    left = threading.Event()
    requests = [Submitted(rt, "b"), Submitted(rt, "c", gone=left.is_set), Submitted(rt, "d")]
    wait_until(lambda: queued_jobs(rt) == 3)
    left.set()  # the entry polls it every 0.25 s: taken first or not, it is never scored
    scorer.release.set()
    first.result()
    outcomes = [request.result() for request in requests]
    # taken into the batch and dropped (its outcome), or withdrawn from the queue (raised)
    assert isinstance(outcomes[1] or requests[1].error, ClientGone)
    assert [outcomes[0].outcome["id"], outcomes[2].outcome["id"]] == ["b", "d"]
    assert all("c" not in batch for batch in scorer.batches)


def test_an_out_of_memory_batch_is_split_until_only_what_cannot_fit_alone_fails():
    scorer = BatchScorer(failing={"c"})
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    requests = [Submitted(rt, name) for name in ["b", "c", "d", "e"]]
    wait_until(lambda: queued_jobs(rt) == 4)
    scorer.release.set()
    first.result()
    outcomes = {request.job.item.id: request.result() for request in requests}
    assert isinstance(outcomes["c"], OutOfMemory)
    assert {name: outcomes[name].outcome["id"] for name in "bde"} == {n: n for n in "bde"}
    assert scorer.batches[1:] == [["b", "c", "d", "e"], ["b", "c"], ["b"], ["c"], ["d", "e"]]


def test_no_request_is_batched_past_a_manager_queued_before_it():
    scorer = BatchScorer()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    before = Submitted(rt, "before")
    wait_until(lambda: queued_jobs(rt) == 1)
    manager = threading.Thread(
        target=rt.register, args=("a", {"source": "test:a", "device": "cpu", "keep_alive_s": 60})
    )
    manager.start()
    wait_until(lambda: len(rt.entry("a")._queue) == 2)  # the request's waiter, the manager's
    after = Submitted(rt, "after")
    wait_until(lambda: queued_jobs(rt) == 2)
    scorer.release.set()
    first.result()
    before.result()
    manager.join(WAIT_S)
    after.result()
    assert scorer.batches == [["first"], ["before"], ["after"]]


def test_replies_say_the_batch_they_ran_in():
    config = settings(**BATCHING)
    scorer = BatchScorer()
    api = testing.TestClient(
        create_app(DecisionService(fake_runtime(scorer, config), config), config)
    )
    one = api.simulate_post("/decide", json=row(), headers=AUTH)
    assert one.status_code == 200, one.text
    assert one.json["batch"] == {"rows": 1, "padded_length": 7}
    assert {key: one.json[key] for key in ("id", "option_ids")} == {
        "id": "r1",
        "option_ids": ["o0", "o1"],
    }
    shared = api.simulate_post(
        "/decide/shared",
        json={"state": "s", "decisions": [decision("a"), decision("b")]},
        headers=AUTH,
    )
    assert shared.status_code == 200, shared.text
    assert shared.json["batch"]["rows"] == 1 and len(shared.json["results"]) == 2


@pytest.mark.parametrize("path", ["/decide", "/decide/shared"])
def test_without_batching_replies_are_as_before(path):
    config = settings()
    api = testing.TestClient(
        create_app(DecisionService(fake_runtime(BatchScorer(), config), config), config)
    )
    body = row() if path == "/decide" else {"state": "s", "decisions": [decision("a")]}
    response = api.simulate_post(path, json=body, headers=AUTH)
    assert response.status_code == 200 and "batch" not in response.json


def test_a_held_lease_and_the_batcher_share_the_model_slots():
    scorer = BatchScorer()
    rt = batching_runtime(scorer)
    holder = Held(rt, "a")  # a request that leases without the batcher (a model just loaded)
    assert holder.admitted.wait(WAIT_S)
    waiting = Submitted(rt, "b")
    wait_until(lambda: queued_jobs(rt) == 1)
    assert not waiting.done.is_set()
    holder.finish()
    assert waiting.result().outcome["id"] == "b"


def test_no_request_is_batched_past_an_older_request_that_leases_the_model():
    """A request that found its model unloaded leases it on its own, with no job: the batcher
    takes no job that arrived after it (d's batch leaves e, which waits its turn)."""
    scorer = BatchScorer()
    rt = batching_runtime(scorer, max_batch_rows=2)
    first = busy(rt, scorer)
    requests = []
    for count, name in enumerate("bcd", start=1):
        requests.append(Submitted(rt, name))
        wait_until(lambda count=count: len(rt.entry("a")._queue) == count)  # in this order
    holder = Held(rt, "a")
    wait_until(lambda: len(rt.entry("a")._queue) == 4)
    last = Submitted(rt, "e")
    jobs_queued(rt, 4)
    scorer.release.set()
    first.result()
    assert holder.admitted.wait(WAIT_S)
    assert scorer.batches == [["first"], ["b", "c"], ["d"]]
    assert not last.done.is_set()
    holder.finish()
    assert [request.result().outcome["id"] for request in requests] == ["b", "c", "d"]
    assert last.result().outcome["id"] == "e"
    assert scorer.batches == [["first"], ["b", "c"], ["d"], ["e"]]


def test_metrics_count_the_forwards_that_ran_and_the_model_list_shows_the_limits():
    """The figures are the scorer's account of each forward it ran, not the budget's estimate
    from the queued costs (which here would say 1 x 1 and 3 x 30 tokens)."""
    scorer = BatchScorer()
    rt = batching_runtime(scorer)
    config = settings(**BATCHING)
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    first = busy(rt, scorer)
    waiting = [
        Submitted(rt, name, rows=rows, length=length)
        for name, rows, length in [("b", 1, 10), ("c", 2, 30)]
    ]
    jobs_queued(rt, 2)
    scorer.release.set()
    for request in [first, *waiting]:
        request.result()
    batches_ended(rt)
    assert scorer.batches == [["first"], ["b", "c"]]
    text = api.simulate_get("/metrics").text
    assert 'semif_batch_rows_count{model="a"} 2.0' in text  # one forward per batch
    assert 'semif_batch_rows_sum{model="a"} 3.0' in text  # 1 + 2 rows, as they ran
    assert 'semif_batch_tokens_sum{model="a"} 21.0' in text  # 7 + 14
    assert 'semif_batch_padding_tokens_total{model="a"} 6.0' in text  # (7 - 5) + (14 - 10)
    models = api.simulate_get("/v1/models", headers=AUTH).json["models"]
    assert models[0]["batching"] == {"max_rows": 4, "max_tokens": 1000, "wait_ms": 0}


def test_each_forward_is_counted_once_however_many_requests_ran_in_it():
    shared, alone = Forward(3, 30, 20), Forward(1, 9, 9)
    jobs = [Job(item=k, cost=Cost(1, 1), engine=None, prepare=lambda engine: None) for k in "abcd"]
    for job, forward in zip(jobs, [shared, shared, alone, None]):
        job.finish(Batched({}, forward.rows if forward else 1, 1, forward))
    jobs.append(Job(item="e", cost=Cost(1, 1), engine=None, prepare=lambda engine: None))
    jobs[-1].finish(OutOfMemory("CUDA out of memory"))  # ran in no forward
    assert forwards(jobs) == [shared, alone]


# -- the pieces on their own -------------------------------------------------------------------


def test_cost_of_an_encoded_input():
    prompt = SimpleNamespace(ids=[0] * 120)
    assert cost_of(SimpleNamespace(prompt=prompt)) == Cost(1, 120)
    prompts = [SimpleNamespace(ids=[0] * n) for n in (90, 150, 100)]
    shared = cost_of(SimpleNamespace(prompts=prompts, prefix_ids=[0] * 80))
    assert shared == Cost(3, 150, 80 + 10 + 70 + 20)  # the state once, then each row's own
    assert (shared.tokens, Cost(3, 150).tokens) == (180, 450)
    assert cost_of([parse_row(row()), parse_row(row())]) == Cost(2, 1)  # a fake's shared rows
    assert cost_of(parse_row(row())) == Cost(1, 1)


def test_a_scorer_without_a_batch_step_scores_each_input_alone():
    class Refusing(FakeScorer):
        def score(self, row):
            if row.id == "bad":
                raise PromptRejected("max_tokens: too long")
            return super().score(row)

    engine = Engine(Refusing())
    good, bad = parse_row(row(id="good")), parse_row(row(id="bad"))
    shared = [parse_row(row(id="s1")), parse_row(row(id="s2"))]
    outcomes = engine.score_batch([good, bad, shared])
    assert outcomes[0].outcome["id"] == "good" and (
        outcomes[0].rows,
        outcomes[0].padded_length,
    ) == (1, 0)
    assert isinstance(outcomes[1].outcome, PromptRejected) and outcomes[1].rows == 1
    results, timing = outcomes[2].outcome
    assert [result["id"] for result in results] == ["s1", "s2"] and outcomes[2].rows == 2
    assert timing["batch_size"] == 2


# -- the service's batched branch (the passthrough grid) ---------------------------------------


def batching_app(scorer, **overrides):
    config = settings(**{**BATCHING, **overrides})
    runtime = fake_runtime(scorer, config)
    return testing.TestClient(create_app(DecisionService(runtime, config), config)), runtime


def test_batching_starts_at_two_rows():
    api, _ = batching_app(FakeScorer(), max_batch_rows=2)
    assert api.simulate_post("/decide", json=row(), headers=AUTH).json["batch"] == {
        "rows": 1,
        "padded_length": 0,
    }


def test_averaged_and_shared_replies_say_their_batch_and_a_refusal_names_its_decision():
    class Refusing(FakeScorer):
        def score_shared(self, rows):
            if rows[1].id == "b":
                raise PromptRejected("rows[1]: letter guard: no", row_index=1)
            return super().score_shared(rows)

    api, _ = batching_app(Refusing())
    averaged = api.simulate_post("/decide", json=row(orderings="rotations"), headers=AUTH)
    assert averaged.status_code == 200, averaged.text
    assert "combined" in averaged.json and averaged.json["batch"] == {"rows": 2, "padded_length": 0}
    refused = api.simulate_post(
        "/decide/shared",
        json={"state": "s", "decisions": [decision("a"), decision("b")]},
        headers=AUTH,
    )
    assert refused.status_code == 422
    assert refused.json["error"]["message"] == "decisions[1] (row 'b'): letter guard: no"


def test_a_batched_request_that_runs_out_of_memory_alone_is_a_503():
    api, _ = batching_app(FakeScorer(error=OutOfMemory("CUDA out of memory (fake)")))
    response = api.simulate_post("/decide", json=row(), headers=AUTH)
    assert response.status_code == 503 and response.json["error"]["code"] == "out_of_memory"


class SizedScorer(BatchScorer):
    """Encodes a row as an object of as many prompt tokens as its question has characters, and
    records which scorer encoded it."""

    def __init__(self):
        super().__init__()
        self.prepared: list[str] = []

    def prepare(self, row):
        self.prepared.append(row.id)
        return SimpleNamespace(
            id=row.id, row=row, by=self, prompt=SimpleNamespace(ids=[0] * len(row.question))
        )

    def score_batch(self, items, left=None):
        assert all(item.by is self for item in items), "scored with another scorer's encoding"
        return super().score_batch([item.row for item in items])


def test_the_service_queues_what_the_scorer_encoded_with_its_cost_and_caller():
    scorer = SizedScorer()
    api, runtime = batching_app(scorer, max_batch_tokens=100)
    scorer.release.clear()
    replies = {}

    def send(name, question, gone=None):
        extras = {} if gone is None else {CLIENT_GONE_KEY: gone}
        replies[name] = api.simulate_post(
            "/decide", json=row(id=name, question=question), headers=AUTH, extras=extras
        )

    first = threading.Thread(target=send, args=("first", "q"))
    first.start()
    assert scorer.entered.wait(WAIT_S)
    left = threading.Event()
    threads = [
        threading.Thread(target=send, args=("b", "x" * 40)),
        threading.Thread(target=send, args=("c", "x" * 40, left.is_set)),
        threading.Thread(target=send, args=("d", "x" * 60)),
    ]
    for count, thread in enumerate(threads, start=1):
        thread.start()
        jobs_queued(runtime, count, model="default")
    left.set()  # c's caller leaves while queued
    scorer.release.set()
    for thread in [first, *threads]:
        thread.join(WAIT_S)
    assert replies["c"].status_code == 499
    assert replies["b"].json["batch"]["rows"] == 1  # b + d: 2 x 60 > 100 tokens
    assert scorer.batches == [["first"], ["b"], ["d"]]
    assert scorer.prepared == ["first", "b", "c", "d"]  # each encoded once, before it queued


class RefusingSecond(SizedScorer):
    """A replaced model's scorer that refuses the row named "second" (too long for it)."""

    def prepare(self, row):
        if row.id == "second":
            raise PromptRejected("max_tokens: the prompt is too long for the new model")
        return super().prepare(row)


@pytest.mark.parametrize("refused", [False, True])
def test_a_batched_request_encoded_by_a_replaced_engine_is_encoded_again(refused):
    """Encoded again by the new model: scored by it, or refused by it as the caller's 422."""
    built = []

    def factory(model_spec):
        built.append(RefusingSecond() if built and refused else SizedScorer())
        return Engine(built[-1])

    config = settings(**BATCHING)
    rt = runtime(spec("a", load_on_startup=True), factory=factory, **BATCHING)
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    [old] = built
    old.release.clear()
    replies = {}

    def send(name):
        replies[name] = api.simulate_post("/decide", json=row(id=name), headers=AUTH)

    first = threading.Thread(target=send, args=("first",))
    first.start()
    assert old.entered.wait(WAIT_S)
    manager = threading.Thread(
        target=rt.register, args=("a", {"source": "test:a", "device": "cpu", "keep_alive_s": 60})
    )
    manager.start()
    wait_until(lambda: len(rt.entry("a")._queue) == 1)  # the reconfigure waits for `first`
    second = threading.Thread(target=send, args=("second",))
    second.start()  # encoded by `old`, queued behind the reconfigure
    jobs_queued(rt, 1)
    old.release.set()
    for thread in (first, manager, second):
        thread.join(WAIT_S)
    [_, new] = built
    assert old.prepared == ["first", "second"]
    if refused:
        assert replies["second"].status_code == 422, replies["second"].text
        message = replies["second"].json["error"]["message"]
        assert message == "max_tokens: the prompt is too long for the new model"
        assert new.batches == []
    else:
        assert replies["second"].status_code == 200, replies["second"].text
        assert new.prepared == ["second"] and new.batches == [["second"]]


# -- every way a batch can end (the batching grid) ----------------------------------------------


def test_a_caller_who_left_once_its_job_was_taken_is_dropped_with_its_own_message():
    scorer = BatchScorer()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    queued = threading.Event()  # set once both have queued: from then on, out of the queue is taken
    leaving = Submitted(rt, "leaving", gone=lambda: queued.is_set() and not queued_jobs(rt))
    staying = Submitted(rt, "staying")
    jobs_queued(rt, 2)
    queued.set()
    scorer.release.set()
    first.result()
    outcome = leaving.result()
    assert isinstance(outcome, ClientGone)
    assert str(outcome) == "the client closed its connection before its request was scored"
    assert staying.result().outcome["id"] == "staying"
    assert scorer.batches == [["first"], ["staying"]]
    batches_ended(rt)
    assert rt.entry("a").status()["queue"]["abandoned_queued"] == 1


def test_a_caller_who_leaves_while_its_batch_runs_is_answered_at_once():
    """Issue 40, defect 9: a request taken into another's batch waited for the batch's end
    however long it ran, its caller long gone (`done.wait()` without a bound); now its thread
    is free as soon as its caller leaves, and the batch still counts it."""
    inside, gate, left = threading.Event(), threading.Event(), threading.Event()

    class Holding(BatchScorer):
        def score_batch(self, items, left=None):
            if any(item.id == "leaving" for item in items):
                inside.set()
                assert gate.wait(WAIT_S), "the test never let the batch end"
            return super().score_batch(items, left)

    scorer = Holding()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    leader = Submitted(rt, "leader")
    leaving = Submitted(rt, "leaving", gone=left.is_set)
    jobs_queued(rt, 2)
    scorer.release.set()
    first.result()
    assert inside.wait(WAIT_S)  # the leader's batch of both is in the engine
    left.set()
    assert leaving.done.wait(WAIT_S), "the request waited for a batch its caller had left"
    assert isinstance(leaving.outcome, ClientGone) and not leader.done.is_set()
    assert str(leaving.outcome) == "the client closed its connection before its request was scored"
    gate.set()
    assert leader.result().outcome["id"] == "leader"
    assert scorer.batches == [["first"], ["leader", "leaving"]]
    batches_ended(rt)
    assert rt.entry("a").status()["queue"]["abandoned_scoring"] == 1


def test_a_job_that_cannot_be_encoded_again_fails_alone():
    scorer = BatchScorer()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)

    def refuse(engine):
        raise PromptRejected("max_tokens: too long for the new model")

    requests = [Submitted(rt, "b"), Submitted(rt, "bad", prepare=refuse), Submitted(rt, "d")]
    jobs_queued(rt, 3)
    scorer.release.set()
    first.result()
    outcomes = [request.result() for request in requests]
    assert isinstance(outcomes[1], PromptRejected) and "new model" in str(outcomes[1])
    assert [outcomes[0].outcome["id"], outcomes[2].outcome["id"]] == ["b", "d"]
    assert scorer.batches == [["first"], ["b", "d"]]


class Miscounting(BatchScorer):
    def score_batch(self, items, left=None):
        return super().score_batch(items)[:1]


class Failing(BatchScorer):
    def score_batch(self, items, left=None):
        super().score_batch(items)
        raise ValueError("a bug in the scorer")


@pytest.mark.parametrize(
    ("scorer", "message"),
    [
        (Miscounting(), "the scorer returned 1 outcomes for 2"),
        (Failing(), "scoring failed: ValueError: a bug in the scorer"),
    ],
)
def test_a_batch_that_fails_as_a_whole_fails_every_request_in_it(scorer, message):
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    requests = [Submitted(rt, "b"), Submitted(rt, "c")]
    jobs_queued(rt, 2)
    scorer.release.set()
    first.result()
    for request in requests:
        outcome = request.result()
        assert isinstance(outcome, ScoringFailed) and str(outcome) == message


def test_a_batched_request_for_an_unloaded_model_loads_it():
    scorer = BatchScorer()
    rt = runtime(spec("a"), factory=Engines(scorer), **BATCHING)
    assert rt.entry("a").engine is None
    outcome = Submitted(rt, "b", prepare=lambda engine: parse_row(row(id="b"))).result()
    assert outcome.outcome["id"] == "b" and rt.entry("a").status()["loaded"]


class Gated(BatchScorer):
    """Its second batch waits at `second` (the first waits at `release`, as BatchScorer's)."""

    def __init__(self):
        super().__init__()
        self.second, self.in_second = threading.Event(), threading.Event()

    def score_batch(self, items, left=None):
        if len(self.batches) == 1:
            self.in_second.set()
            assert self.second.wait(WAIT_S)
        return super().score_batch(items)


def test_requests_whose_jobs_were_taken_leave_the_queue_while_their_batch_runs():
    scorer = Gated()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    requests = [Submitted(rt, name) for name in "bcd"]
    jobs_queued(rt, 3)
    wait_until(lambda: rt.entry("a").status()["queued_requests"] == 3)
    scorer.release.set()
    assert scorer.in_second.wait(WAIT_S)  # b leads; b, c and d are in its batch
    wait_until(lambda: rt.entry("a").status()["queued_requests"] == 0)
    assert rt.entry("a")._active == 1  # only the leader holds a slot
    scorer.second.set()
    first.result()
    assert [request.result().outcome["id"] for request in requests] == ["b", "c", "d"]


def test_a_batch_waits_for_company_until_it_is_full_or_the_wait_ends():
    scorer = BatchScorer()
    rt = batching_runtime(scorer, max_batch_rows=2, batch_wait_ms=1000)
    lone = Submitted(rt, "lone")
    wait_until(lambda: rt.entry("a")._active == 1)  # it leads, waiting for a second request
    company = Submitted(rt, "company")  # fills the batch: it runs at once
    assert lone.result().outcome["id"] == "lone" and company.result().outcome["id"] == "company"
    assert scorer.batches == [["lone", "company"]]
    quick = batching_runtime(BatchScorer(), batch_wait_ms=20)
    assert Submitted(quick, "alone").result().outcome["id"] == "alone"  # after its 20 ms


def test_each_model_batches_its_own_requests_and_a_request_keeps_its_timeout():
    scorers = {"a": BatchScorer(), "b": BatchScorer()}
    config = settings(**BATCHING)
    rt = Runtime(
        config,
        lambda model_spec: Engine(scorers[model_spec.id]),
        [spec("a", load_on_startup=True), spec("b", load_on_startup=True)],
        "a",
    )
    rt.start(idle_interval_s=None)
    api = testing.TestClient(create_app(DecisionService(rt, config), config))
    reply = api.simulate_post("/decide", json=row(id="for-b", model="b"), headers=AUTH)
    assert reply.status_code == 200 and scorers["b"].batches == [["for-b"]]
    assert scorers["a"].batches == []
    scorers["b"].release.clear()
    scorers["b"].entered.clear()  # set by the first request: wait for this one's entry
    busy_b = threading.Thread(
        target=api.simulate_post,
        args=("/decide",),
        kwargs={"json": row(id="hold", model="b"), "headers": AUTH},
    )
    busy_b.start()
    assert scorers["b"].entered.wait(WAIT_S)
    late = api.simulate_post(
        "/decide", json=row(id="late", model="b", timeout_s=0.05), headers=AUTH
    )
    assert late.status_code == 503 and late.json["error"]["code"] == "server_busy"
    scorers["b"].release.set()
    busy_b.join(WAIT_S)


def test_a_manager_queued_while_a_batch_waits_for_company_is_not_passed():
    """SEMIF_BATCH_WAIT_MS > 0: the leader waits for company; a reconfigure that queues ends
    that wait at once (the leader runs alone), and a request sent after the manager is not
    passed ahead of it: it waits for the manager, then leads a later batch (a third request
    fills that batch, so nobody waits out the long wait)."""
    scorer = BatchScorer()
    scorer.release.clear()  # the lone batch stays in the engine: the queued manager is seen
    rt = batching_runtime(scorer, max_batch_rows=2, batch_wait_ms=60_000)  # past any bound here
    entry = rt.entry("a")
    gathering = watch_waits(entry, lambda: entry._active == 1, "_work")
    lone = Submitted(rt, "lone")
    assert gathering.wait(WAIT_S)  # it leads: the dispatcher waits for company
    assert not scorer.entered.is_set()
    manager = threading.Thread(
        target=rt.register, args=("a", {"source": "test:a", "device": "cpu", "keep_alive_s": 60})
    )
    manager.start()
    assert scorer.entered.wait(WAIT_S)  # the manager ended the leader's wait, not its 60 s
    wait_until(lambda: any(not waiter.is_request for waiter in rt.entry("a")._queue))
    after = Submitted(rt, "after")
    jobs_queued(rt, 1)  # behind the manager
    scorer.release.set()
    assert lone.result().outcome["id"] == "lone"
    manager.join(WAIT_S)
    assert not manager.is_alive()
    company = Submitted(rt, "company")
    assert after.result().outcome["id"] == "after"
    assert company.result().outcome["id"] == "company"
    assert scorer.batches == [["lone"], ["after", "company"]]


def test_a_batch_whose_run_fails_still_ends_every_request_in_it(monkeypatch, caplog):
    from semif_serve.runtime import registry

    scorer = BatchScorer()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    requests = [Submitted(rt, "b"), Submitted(rt, "c")]
    jobs_queued(rt, 2)
    real = registry.run_jobs

    def broken(*args):
        monkeypatch.setattr(registry, "run_jobs", real)  # once
        raise RuntimeError("a broken run")

    monkeypatch.setattr(registry, "run_jobs", broken)
    scorer.release.set()
    first.result()
    outcomes = [request.result() for request in requests]  # bounded: nobody waits forever
    assert isinstance(outcomes[0], RuntimeError)  # the leader's, b's: its request raises it
    assert [r.getMessage() for r in caplog.records if r.levelname == "ERROR"] == [
        "a batch of model a stopped"
    ]
    assert isinstance(outcomes[1], ScoringFailed)
    assert str(outcomes[1]) == "the batch stopped before this request"
    assert scorer.batches == [["first"]]
    assert Submitted(rt, "d").result().outcome["id"] == "d"  # the slot was released
    assert scorer.batches == [["first"], ["d"]]


def test_a_metrics_hook_that_fails_is_logged_and_costs_no_request(caplog):
    scorer = BatchScorer()
    rt = batching_runtime(scorer)

    def broken(*figures):
        raise RuntimeError("a broken metrics hook")

    rt.on_batch = broken
    assert Submitted(rt, "b").result().outcome["id"] == "b"
    batches_ended(rt)
    assert [record.getMessage() for record in caplog.records] == [
        "recording a batch of model a failed"
    ]


@pytest.mark.parametrize(
    ("wait_s", "deadlines", "ends"),
    [
        (5.0, [None], 1005.0),  # no deadline: the leader's own wait
        (5.0, [(1010.0, 1.0)], 1005.0),  # a deadline after the wait
        (5.0, [None, (1002.0, 0.2)], 1002.0 - 0.02),  # a companion's is nearer: 20 ms before
        (5.0, [(1003.0, 4.0), (1002.5, 4.0)], 1002.5 - 0.2),  # the earliest; 5% of 4 s
        (5.0, [(1002.0, 0.4), (1002.1, 8.0)], 1002.1 - 0.4),  # the margin counts: 1001.7 first
        (0.0, [(1002.0, 1.0)], 1000.0),  # no wait at all
        (5.0, [(1000.01, 1.0)], 1000.01 - 0.05),  # already too near: it runs at once
    ],
)
def test_a_batch_waits_for_company_until_its_wait_or_the_earliest_deadline_it_holds(
    wait_s, deadlines, ends
):
    held = [NEVER if d is None else Deadline(*d) for d in deadlines]
    assert gather_ends(1000.0, wait_s, held) == pytest.approx(ends)


def test_a_batch_that_is_not_full_keeps_waiting_while_only_batched_requests_queue():
    scorer = BatchScorer()
    rt = batching_runtime(scorer, max_batch_rows=3, batch_wait_ms=60_000)  # past any bound here
    # The dispatcher waits again once it has seen `first` queued: two of three rows, not full.
    entry = rt.entry("a")
    waits = watch_waits(entry, lambda: entry._active == 1 and queued_jobs(rt) == 1, "_work")
    lone = Submitted(rt, "lone")
    wait_until(lambda: rt.entry("a")._active == 1)
    first = Submitted(rt, "first")
    assert waits.wait(WAIT_S), "the leader stopped waiting for company with two of three rows"
    assert not lone.done.is_set() and scorer.batches == []
    second = Submitted(rt, "second")  # the third row: full, it runs
    assert [r.result().outcome["id"] for r in (lone, first, second)] == ["lone", "first", "second"]
    assert scorer.batches == [["lone", "first", "second"]]


def test_the_engine_is_told_whose_caller_left_while_the_batch_runs_and_it_is_counted():
    """`run_jobs` hands the engine each job's own gone check (asked before each forward); a
    caller who left during the call is counted as abandoned while scoring, one who left before
    it as abandoned while queued."""
    left_now = threading.Event()

    class Asking(BatchScorer):
        asked: dict = {}

        def score_batch(self, items, left=None):
            if any(item.id == "leaving" for item in items):
                left_now.set()  # its caller goes while this batch runs
                self.asked = {item.id: left(item) for item in items}
            return super().score_batch(items)

    scorer = Asking()
    rt = batching_runtime(scorer)
    first = busy(rt, scorer)
    leaving = Submitted(rt, "leaving", gone=left_now.is_set)
    staying = Submitted(rt, "staying")
    jobs_queued(rt, 2)
    before = Submitted(rt, "before", gone=lambda: True)  # leaves the queue, never taken
    before.result()
    assert isinstance(before.error, ClientGone)
    scorer.release.set()
    first.result()
    assert staying.result().outcome["id"] == "staying"
    leaving.result()
    assert scorer.asked == {"leaving": True, "staying": False}
    batches_ended(rt)
    [status] = rt.status()
    assert (status["queue"]["abandoned_scoring"], status["queue"]["abandoned_queued"]) == (1, 1)


def test_a_batch_is_timed_into_its_models_pace_as_it_runs():
    """Each batch counts in the model's pace as one call: the tokens and requests it ran, over
    the seconds from the start of its engine call to its end."""
    clock = Clock()

    class Timed(BatchScorer):
        def score_batch(self, items, left=None):
            clock.now += 2.0  # each batch takes 2 s on the clock
            return super().score_batch(items)

    scorer = Timed()
    rt = batching_runtime(scorer, clock=clock)
    first = busy(rt, scorer)  # 1 row of 1 token
    waiting = [Submitted(rt, name, length=10) for name in ("b", "c")]
    jobs_queued(rt, 2)
    scorer.release.set()
    first.result()
    for submitted in waiting:
        submitted.result()
    batches_ended(rt)
    assert scorer.batches == [["first"], ["b", "c"]]
    rate = rt.entry("a").pace.rate
    assert rate.seconds_for(21) == pytest.approx(4.0)  # 21 tokens in 4 s
    assert rate.request_tokens() == pytest.approx(7.0)  # over 3 requests


def test_a_queued_batched_request_counts_its_own_work_in_the_estimate():
    clock = Clock()
    scorer = BatchScorer()
    rt = batching_runtime(scorer, clock=clock)
    entry = rt.entry("a")
    entry.pace.rate.record(100, 1, 5.0)  # 0.05 s a token; the mean request 100 tokens
    first = busy(rt, scorer)  # 1 token running, just started: 0.05 s left
    waiting = Submitted(rt, "b", length=40)
    jobs_queued(rt, 1)
    assert entry.estimated_wait() == pytest.approx(40 * 0.05 + 0.05)
    scorer.release.set()
    first.result()
    waiting.result()
