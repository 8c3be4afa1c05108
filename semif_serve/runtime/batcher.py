"""`Batcher`: one model's queued decision requests, scored together (issue 23).

A request submits its job (its encoded input and cost), then asks the model for a slot as every
request does (`ModelEntry.acquire`: FIFO, managers, timeouts, a caller who leaves). Whoever holds
a slot leads: it takes the oldest jobs nobody has taken (`batching.select`, within
SEMIF_MAX_BATCH_ROWS and SEMIF_MAX_BATCH_TOKENS; never one that arrived after a queued waiter
whose work it cannot take, a manager or a request leasing the model on its own, which nothing
barges past) and runs them as one engine call, then repeats until its own job has been taken.
A request whose job another leader took leaves the queue at once and waits for its outcome.
A job nobody took when its caller's queue timeout passed, or its caller left, leaves unscored
(503 `server_busy`, 499); once taken, it is scored, unless its caller has left by the time the
batch runs (dropped then, 499).

A batch that runs out of memory is split in halves and each half run again, so that only a
request that cannot fit alone gets 503 `out_of_memory`.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from semif_serve.errors import ClientGone, OutOfMemory, ScoringFailed
from semif_serve.runtime.batching import Cost, padded_tokens, select


@dataclass(eq=False)
class Job:
    """One request's part of a batch; `outcome` is set (its result, or the exception it gets)
    and `done` set once it has been scored or dropped."""

    item: Any  # what the engine's score_batch takes, encoded by `engine`
    cost: Cost
    engine: Any  # whose tokenizer encoded `item`
    prepare: Callable[[Any], Any]  # encodes the request for another engine (a reloaded model)
    gone: Callable[[], bool] | None = None
    submitted: float = field(default_factory=lambda: time.monotonic())
    taken: bool = False
    outcome: Any = None
    done: threading.Event = field(default_factory=threading.Event)

    def finish(self, outcome: Any) -> None:
        self.outcome = outcome
        self.done.set()


class Batcher:
    """One model's queue of jobs, oldest first."""

    def __init__(
        self,
        max_rows: int,
        max_tokens: int,
        wait_s: float,
        observe: Callable[[int, int, int], None],
    ):
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.wait_s = wait_s
        # Told (rows, padded tokens, the requests' own tokens) of each batch taken (metrics).
        self.observe = observe
        self._cond = threading.Condition()
        self._queue: deque[Job] = deque()

    def submit(self, job: Job) -> None:
        with self._cond:
            self._queue.append(job)
            self._cond.notify_all()

    def withdraw(self, job: Job) -> bool:
        """Take `job` out of the queue unscored; False when a leader has taken it already."""
        with self._cond:
            if job.taken:
                return False
            self._queue.remove(job)
            return True

    def take(self, cutoff: Callable[[], float | None]) -> list[Job]:
        """The next batch: the oldest jobs submitted no later than `cutoff()` (when the first
        queued waiter it cannot serve arrived; None: none is), asked again after every wait,
        within the limits. While it is not full and no such waiter waits, it waits for more
        until its oldest job has waited `wait_s` (time in the queue counts, as Triton's queue
        delay does); a waiter that queues meanwhile is seen at the next submit or at the end."""
        with self._cond:
            while True:
                before = cutoff()
                eligible = [job for job in self._queue if before is None or job.submitted <= before]
                count = select([job.cost for job in eligible], self.max_rows, self.max_tokens)
                rows = sum(job.cost.rows for job in eligible[:count])
                full = count < len(eligible) or rows >= self.max_rows
                if full or not eligible or before is not None:
                    break
                remaining = eligible[0].submitted + self.wait_s - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
            batch = eligible[:count]
            for job in batch:
                job.taken = True
                self._queue.remove(job)
        return batch

    def record(self, batch: list[Job]) -> None:
        """Tell `observe` of a batch taken: its rows, padded tokens and real tokens, as the
        limits count them (a shared unit or a group over one state runs as its own forward)."""
        costs = [job.cost for job in batch]
        if costs:
            real = sum(cost.rows * cost.length for cost in costs)
            self.observe(sum(cost.rows for cost in costs), padded_tokens(costs), real)

    @property
    def queued(self) -> int:
        return len(self._queue)


def run_batch(engine: Any, jobs: list[Job]) -> None:
    """Score `jobs` in one engine call and hand each its outcome: those whose caller left are
    dropped first; an out-of-memory batch is split in halves; any other failure is every job's."""
    live = []
    for job in jobs:
        if job.gone is not None and job.gone():
            job.finish(ClientGone("the client closed its connection before its request was scored"))
            continue
        if job.engine is not engine:  # encoded for an engine since replaced: encode again
            try:
                job.item, job.engine = job.prepare(engine), engine
            except Exception as error:  # noqa: BLE001 - handed to its request, raised there
                job.finish(error)
                continue
        live.append(job)
    if live:
        _scored(engine, live)


def _scored(engine: Any, jobs: list[Job]) -> None:
    try:
        outcomes = engine.score_batch([job.item for job in jobs])
        if len(outcomes) != len(jobs):
            raise ScoringFailed(f"the scorer returned {len(outcomes)} outcomes for {len(jobs)}")
    except OutOfMemory as error:
        if len(jobs) == 1:
            jobs[0].finish(error)
            return
        middle = len(jobs) // 2
        _scored(engine, jobs[:middle])
        _scored(engine, jobs[middle:])
        return
    except Exception as error:  # noqa: BLE001 - every job's, raised in its own request
        for job in jobs:
            job.finish(error)
        return
    for job, outcome in zip(jobs, outcomes):
        job.finish(outcome)


def serve(
    entry: Any,
    batcher: Batcher,
    job: Job,
    timeout: float | None,
    load: Callable[[Any], None],
) -> Any:
    """`job`'s outcome (its `Batched` result, or the exception its request raises), scored by
    whichever request leads when it is taken (see the module). `QueueTimeout` or `WaiterGone`
    when it left the queue untaken."""
    batcher.submit(job)
    try:
        engine = entry.acquire(timeout, load, job.gone, served=lambda: job.taken)
    except BaseException:
        if batcher.withdraw(job):
            raise
        # else: taken meanwhile; it is scored, and this request waits for it
    else:
        if engine is not None:  # None: another leader took it
            _lead(entry, batcher, job, engine)
    job.done.wait()  # taken: a leader is running it, and every batch finishes every job
    return job.outcome


def _lead(entry: Any, batcher: Batcher, job: Job, engine: Any) -> None:
    """Holding a slot: run batches of the oldest jobs until `job` has been taken, then release."""

    def cutoff() -> float | None:
        arrival = entry.unbatched_arrival()  # its own job came before any such waiter
        return None if arrival is None else max(arrival, job.submitted)

    try:
        while not job.taken:
            batch = batcher.take(cutoff)
            try:
                entry.wake()  # the requests whose jobs it took leave the queue now
                batcher.record(batch)
                run_batch(engine, batch)
            finally:  # whatever happened, no request waits for a job left unfinished
                for taken in batch:
                    if not taken.done.is_set():
                        taken.finish(ScoringFailed("the batch stopped before this request"))
    finally:
        entry.release()
