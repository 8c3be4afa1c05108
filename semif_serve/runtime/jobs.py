"""`Job`: one batched request's work, and `run_jobs`: a batch of them, run as one engine call;
`Waiter`: a place in a model's queue, a request's (holding its job) or a manager's.

A request that may be batched (SEMIF_MAX_BATCH_ROWS > 1, its input encoded before it queued)
hands its scheduler a `Job`. The model's dispatcher takes it into a batch (it decides who and
which) and runs the batch in a thread of its own; the request only waits for `done`
(`awaited`: or until its caller leaves), and every way a batch can end finishes every job in
it. Before the engine call each job is looked at once more: a job whose request pinned
another configuration than the model's is finished unscored (`pinned_to`, 503), one whose
caller left is dropped (499), one encoded by an engine since replaced is encoded again.
When models share one device, the batch waits for its turn there within its jobs' deadlines,
dropping those that expire (503) or whose caller leaves (499) while it waits.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from semif_serve.errors import ClientGone, ConfigurationChanged, QueueTimedOut
from semif_serve.runtime.pinning import Pinned
from semif_serve.runtime.selection import Cost
from semif_serve.runtime.specs import ModelSpec
from semif_serve.runtime.waiting import GONE_POLL_S, NEVER, Deadline, Gone, WaiterGone

STOPPED = "the batch stopped before this request"
LEFT = "the client closed its connection before its request was scored"


@dataclass(eq=False)
class Job:
    """One request's part of a batch; `outcome` is set (its result, or the exception its request
    raises) and `done` set once it has been scored or dropped."""

    item: Any  # what the engine's score_batch takes, encoded by `engine`
    cost: Cost
    engine: Any  # whose tokenizer encoded `item`
    prepare: Callable[[Any], Any]  # encodes the request for another engine (a reloaded model)
    gone: Callable[[], bool] | None = None
    deadline: Deadline = NEVER
    pinned: Pinned | None = None  # the configuration its request's earlier calls ran under
    submitted: float = field(default_factory=time.monotonic)  # a batch's wait counts from it
    left_while_scoring: bool = False  # scored, its caller gone before it was handed the result
    outcome: Any = None
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self, outcome: Any) -> None:
        if not self.done.is_set():
            self.outcome = outcome
            self.done.set()

    def dropped(self, expired: bool) -> bool:
        """Finish this job unscored if its caller left, or (`expired`: asked after a wait) its
        deadline passed; True if so. A deadline bounds waits: a job that never waited for
        anything since it was taken runs, however short its timeout."""
        if self.gone is not None and self.gone():
            self.finish(ClientGone(LEFT))
        elif expired and self.deadline.passed:
            self.finish(QueueTimedOut(f"waited {self.deadline.timeout_s:g} s before its batch ran"))
        return self.done.is_set()


def awaited(job: Job) -> Any:
    """A taken job's outcome, once its batch has finished it; a caller who leaves meanwhile is
    not kept waiting for the batch (its thread is free within GONE_POLL_S): ClientGone at once,
    while the batch drops the job or scores it for no one, and counts it either way."""
    while not job.done.wait(GONE_POLL_S):
        if job.gone is not None and job.gone():
            return ClientGone(LEFT)
    return job.outcome


def run_jobs(
    engine: Any,
    jobs: list[Job],
    device: Any = None,
    started: Callable[[list[Job]], None] = lambda jobs: None,
) -> list[Job]:
    """Score `jobs` in one engine call (with the device's turn, when models share one) and hand
    each its outcome; returns the jobs the call scored. Any failure of the call is each of
    their outcomes (the scheduler finishes whatever a stop left unfinished). `started` is told
    the jobs the call runs as it starts (the device its own)."""
    live = _encoded(engine, _live(jobs, expired=False))
    if device is None:
        started(live)
        _scored(engine, live)
        return live
    try:
        # While it waits, each job whose deadline passes or whose caller leaves is dropped
        # (within GONE_POLL_S); the batch leaves the queue once none is left.
        waited = device.take(gone=lambda: not _live(live, expired=True))
    except WaiterGone:
        return []
    try:
        live = _live(live, expired=waited)  # one that expired since the last look
        started(live)
        _scored(engine, live)
        return live
    finally:
        device.give()


def pinned_to(spec: ModelSpec, jobs: list[Job]) -> list[Job]:
    """The jobs that may run under `spec` (the model's, held by their batch): each whose
    request pinned another configuration is finished with its ConfigurationChanged."""
    kept = []
    for job in jobs:
        if job.pinned is not None:
            try:
                job.pinned.check(spec)
            except ConfigurationChanged as error:
                job.finish(error)
                continue
        kept.append(job)
    return kept


def forwards(jobs: list[Job]) -> list[Any]:
    """The forwards the jobs' engine call ran, each once (their `Batched` outcomes name them)."""
    ran: dict[int, Any] = {}
    for job in jobs:
        forward = getattr(job.outcome, "forward", None)
        if forward is not None:
            ran.setdefault(id(forward), forward)
    return list(ran.values())


def abandoned(jobs: list[Job]) -> tuple[int, int]:
    """Of a batch's jobs, how many its callers left before their forward ran (never run) and
    while it ran (scored for no one)."""
    before = sum(1 for job in jobs if isinstance(job.outcome, ClientGone))
    during = sum(1 for job in jobs if job.left_while_scoring)
    return before, during


def _encoded(engine: Any, jobs: list[Job]) -> list[Job]:
    """The jobs, each encoded by `engine` (one encoded for an engine since replaced is encoded
    again; one that cannot be is finished with its error)."""
    ready = []
    for job in jobs:
        if job.engine is not engine:
            try:
                job.item, job.engine = job.prepare(engine), engine
            except Exception as error:  # noqa: BLE001 - handed to its request, raised there
                job.finish(error)
                continue
        ready.append(job)
    return ready


def _live(jobs: list[Job], expired: bool) -> list[Job]:
    return [job for job in jobs if not job.dropped(expired)]


def _scored(engine: Any, jobs: list[Job]) -> None:
    """Each job's outcome from one engine call (`Engine.score_batch` hands every job its own:
    a result, or the failure of the part it ran in; whatever else stops it, the scheduler
    finishes the jobs left)."""
    if not jobs:
        return
    callers = {id(job.item): job.gone for job in jobs if job.gone is not None}

    def left(item: Any) -> bool:  # asked before each forward of the call
        gone = callers.get(id(item))
        return gone is not None and gone()

    outcomes = engine.score_batch([job.item for job in jobs], left=left)
    for job, outcome in zip(jobs, outcomes):
        # Asked before it is handed the result: once it has it, its request replies and its
        # caller may close the connection, which is no abandonment.
        job.left_while_scoring = not isinstance(outcome, ClientGone) and left(job.item)
        job.finish(outcome)


RunBatch = Callable[[Any, list[Job]], None]  # (engine, jobs): the runtime's device turn and call
Load = Callable[[Any], None]  # loads the model a `scheduler.ModelScheduler` holds (the runtime's)


@dataclass(eq=False)
class Waiter:
    """A place in a model's queue (`scheduler.ModelScheduler`): a request, with its job when it
    may be batched, or a manager. Its model's dispatcher lets it in (`granted`); until then it
    waits, within its deadline, and leaves when it ends."""

    deadline: Deadline = NEVER
    gone: Gone | None = None
    job: Job | None = None  # a batched request's work (a batch may take it)
    is_request: bool = True  # else a manager
    tokens: int = 0  # the request's work (`Cost.tokens`); 0: not known yet (not encoded)
    load: Load | None = None  # a request's: how to load the model if it finds it unloaded
    run: RunBatch | None = None  # a batched request's: how its batch runs, if it leads one
    queued: float = field(default_factory=time.monotonic)
    estimate_s: float | None = None  # its wait as estimated when it queued (`Pace`)
    granted: bool = False  # let in: it holds a slot (or the model), or a batch took its job
    refused: BaseException | None = None  # let in, but its model's load could not start
    awaits_load: bool = False  # a batched request at the head, waiting for its model's load
