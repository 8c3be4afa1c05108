"""`Engine`: the one object that runs scorer calls, one at a time, and applies the memory policy.

It holds the process-wide lock (INV-2: scorer calls never overlap) and the failure policy
(INV-4, bug hunt C4, C5, S9):
- a `RowError` (the scoring package's own refusal of a row) is the caller's fault and passes
  through (422); no other exception is;
- an out-of-memory error (torch's OutOfMemoryError, or a RuntimeError from cuBLAS/cuDNN that says
  "out of memory") becomes `OutOfMemory` (503), reported as "CUDA out of memory" when the error
  came with no message;
- anything else is logged with its traceback and becomes `ScoringFailed` (500).
What runs again after an out-of-memory error is `oom_policy`'s (a batch is split first; a single
request may then drop its own model's stored prefixes and run once more without the cache).
Both are raised *unchained*, after the failed call's frames are gone and `gc.collect()` ran, and
only then is the allocator cache emptied: a chained exception would keep the failed call's
tensors alive (on the card, 11.9 GiB stayed allocated after a 503).
After every successful call on a GPU, reserved memory more than 512 MiB over the post-warm-up
baseline plus the state-prefix cache's stored bytes is handed back (`empty_cache`), so a burst
does not keep the card's shared headroom. Closing the engine drops the model's stored prefixes.

`prepare` and `prepare_shared` encode a request before it queues, without the lock (a scorer
with no such step gets its rows as they are), under the same failure policy less the memory
handling; their result is what `score` and `score_shared` take.

torch is passed in (`torch_module`), so the policy is tested against a fake torch.
"""

from __future__ import annotations

import gc
import logging
import threading
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any, Protocol

from semif_serve.engine.oom_policy import is_out_of_memory, relieved, split
from semif_serve.errors import LEFT_BEFORE_FORWARD, ClientGone, OutOfMemory, ScoringFailed
from semif_serve.scoring.inputs import Batched
from semif_serve.scoring.rows import Row, RowError

log = logging.getLogger(__name__)

RELEASE_MARGIN_BYTES = 512 * 1024 * 1024
EMPTY_OOM_MESSAGE = "CUDA out of memory"


class Scorer(Protocol):
    """What the engine drives: the torch scorer in production, fakes in tests."""

    def model_info(self) -> dict[str, Any]: ...
    def score(self, row: Row) -> dict[str, Any]: ...
    def score_shared(self, rows: list[Row]) -> tuple[list[dict[str, Any]], dict[str, Any]]: ...

    # Optional: `prepare(row)` and `prepare_shared(rows)` (the encoding stage, run without the
    # lock; `score` and `score_shared` then take their results), `cache_stats()` (the model's
    # state-prefix cache figures, None when off), `held_bytes()` (bytes its cache keeps between
    # calls) and `close()`.


class Engine:
    """One loaded model. `concurrency` scorer calls may run at once (its slots; 1 = a lock)."""

    def __init__(
        self,
        scorer: Scorer,
        *,
        device: str = "cpu",
        torch_module: Any = None,
        concurrency: int = 1,
        max_parallel_slots: int | None = None,
        lock: Any = None,
    ):
        self._scorer: Scorer | None = scorer
        # `lock`: one process-wide lock shared by every engine (the single-lock runtime, INV-2).
        self._owns_lock = lock is None
        self._lock = lock or threading.BoundedSemaphore(concurrency)
        self._device = device
        self._torch = torch_module
        self.baseline_reserved: int | None = None
        self.max_parallel_slots = max_parallel_slots
        self.resident_bytes: int | None = None  # what the loaded model holds (the memory budget)
        # Set by the loader when known: the slots that fit for a max_tokens, and (GPU) the
        # longest prompt warm-up ran; see `capacity_at`.
        self.capacity_for: Callable[[int], int] | None = None
        self.warmed_max_tokens: int | None = None

    @property
    def on_gpu(self) -> bool:
        return self._device.startswith("cuda")

    def model_info(self) -> dict[str, Any]:
        return self._scorer.model_info()

    def prepare(self, row: Row) -> Any:
        """`row` encoded for `score`, every limit checked, outside the lock (None: the model
        has been closed meanwhile)."""
        return self._prepared("prepare", row)

    def prepare_shared(self, rows: list[Row]) -> Any:
        """`rows` encoded for `score_shared`, as `prepare` does."""
        return self._prepared("prepare_shared", rows)

    def score(self, row: Row) -> dict[str, Any]:
        return relieved(
            lambda cached: self._call(self._method("score", cached), row), self._relief()
        )

    def score_shared(self, rows: list[Row]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        return relieved(
            lambda cached: self._call(self._method("score_shared", cached), rows), self._relief()
        )

    def score_batch(self, items: list[Any], left: Callable[[Any], bool] | None = None) -> list[Any]:
        """Several requests' encoded inputs (a batch): each one's outcome, in order
        (`scoring.inputs.Batched`: a result, or the exception its own scoring raised; or the
        exception of the call it was part of), in as few locked calls as memory allows
        (`oom_policy.split`). A scorer without a batch step scores them one by one. `left(item)`:
        True once that item's caller has gone; it is asked before each forward, and an item
        whose caller left is not run (`ClientGone`)."""
        return split(items, partial(self._batch_call, left=left), self._relief())

    def _batch_call(
        self, items: list[Any], cached: bool, left: Callable[[Any], bool] | None = None
    ) -> list[Any]:
        if hasattr(self._scorer, "score_batch"):
            run = self._method("score_batch", cached)
            if left is not None:
                run = partial(run, left=left)
        else:
            run = partial(_each, self._one, left=left)
        outcomes = self._call(run, items)
        if len(outcomes) != len(items):
            raise ScoringFailed(f"the scorer returned {len(outcomes)} outcomes for {len(items)}")
        return outcomes

    def _method(self, name: str, cached: bool) -> Callable[[Any], Any]:
        """The scorer's `name`, without its prefix cache unless `cached` (the policy's retry)."""
        method = getattr(self._scorer, name)
        return method if cached else partial(method, cached=False)

    def _relief(self) -> Callable[[str], bool] | None:
        """The scorer's way to free its own model's stored prefixes for a shortfall, taken
        under the lock (None: it keeps none, so an out-of-memory error is final)."""
        relieve = getattr(self._scorer, "relieve", None)
        if relieve is None:
            return None

        def locked(message: str) -> bool:
            with self._lock:
                return relieve(message)

        return locked

    def _one(self, item: Any) -> Any:
        shared = isinstance(item, list)  # a shared call's rows, else one row
        try:
            value = self._scorer.score_shared(item) if shared else self._scorer.score(item)
        except RowError as error:
            value = error
        return Batched(value, len(item) if shared else 1, 0)

    def batch_tokens(self, rows: int, length: int) -> int:
        """The tokens one batch forward of `rows` rows whose longest prompt is `length` holds as
        this model runs it (the batch budget's count): its scorer's (shape buckets on CUDA),
        else rows x length."""
        count = getattr(self._scorer, "batch_tokens", None)
        return rows * length if count is None else count(rows, length)

    def cache_stats(self) -> dict[str, int] | None:
        """The model's state-prefix cache: hits, misses, evictions, bytes, entries (None: off)."""
        stats = getattr(self._scorer, "cache_stats", None)
        return None if stats is None else stats()

    def capacity_at(self, max_tokens: int) -> int | None:
        """The slots that fit with prompts of up to `max_tokens`, for a reconfigure that keeps
        this engine (`retune`); None when only a new engine can say: the capacity is unknown,
        the weights on disk changed since the load, or `max_tokens` passes the longest prompt
        warm-up ran (its shapes were never built)."""
        if self.capacity_for is None or not hasattr(self._scorer, "max_tokens"):
            return None
        unchanged = getattr(self._scorer, "weights_unchanged", None)
        if unchanged is not None and not unchanged():
            return None  # a local folder rewritten since the load: only a reload serves it
        if self.warmed_max_tokens is not None and max_tokens > self.warmed_max_tokens:
            return None
        return self.capacity_for(max_tokens)

    def retune(self, max_tokens: int, slots: int) -> None:
        """Serve prompts of up to `max_tokens` with `slots` calls at once, keeping the loaded
        weights and stored prefixes. The caller holds the model alone (no call in flight), so
        this engine's own slot semaphore may be replaced."""
        capacity = self.capacity_at(max_tokens)
        if capacity is None or slots > capacity:
            raise ValueError(f"cannot serve {slots} slots of {max_tokens} tokens in place")
        self._scorer.max_tokens = max_tokens
        self.max_parallel_slots = capacity
        if self._owns_lock:
            self._lock = threading.BoundedSemaphore(slots)

    def close(self) -> None:
        """Drop the model and hand its memory back; the engine serves nothing afterwards."""
        with self._lock:
            scorer, self._scorer = self._scorer, None
        if hasattr(scorer, "close"):
            scorer.close()
        del scorer
        gc.collect()
        self._empty_cache()

    def record_baseline(self) -> None:
        """Remember reserved memory now (after warm-up): the level a finished call returns to."""
        if self.on_gpu:
            self.baseline_reserved = self._torch.cuda.memory_reserved(self._device)

    def _prepared(self, name: str, argument: Any) -> Any:
        scorer = self._scorer
        if scorer is None:
            return None
        method = getattr(scorer, name, None)
        if method is None:
            return argument
        try:
            return method(argument)
        except RowError:
            raise
        except Exception as error:
            failure = self._failure(error)
        raise failure

    def _call(self, method: Callable, argument: Any) -> Any:
        with self._lock:
            try:
                result = method(argument)
            except RowError:  # the project's own refusal of a row: the caller's 422
                raise
            except Exception as error:
                failure = self._failure(error)
            else:
                self._release_over_baseline()
                return result
            # Here the except block has ended: the error, its traceback and the failed call's
            # frames (holding its tensors) are unreachable. Collect cycles, then empty the cache.
            gc.collect()
            self._empty_cache()
            raise failure

    def _failure(self, error: Exception) -> OutOfMemory | ScoringFailed:
        """The unchained exception to raise for `error` (built while `error` is still known)."""
        if is_out_of_memory(error, self._torch):
            message = str(error).strip() or EMPTY_OOM_MESSAGE
            log.warning("out of memory during scoring: %s", message.splitlines()[0])
            return OutOfMemory(message)
        # The traceback goes to the log as text: a record holding exc_info (pytest's caplog, an
        # error tracker) would keep the failed call's frames and tensors alive.
        log.error("scorer call failed:\n%s", "".join(traceback.format_exception(error)).rstrip())
        return ScoringFailed(f"scoring failed: {type(error).__name__}: {error}")

    def _release_over_baseline(self) -> None:
        if self.baseline_reserved is None:
            return
        reserved = self._torch.cuda.memory_reserved(self._device)
        held = getattr(self._scorer, "held_bytes", None)
        kept = self.baseline_reserved + (held() if held is not None else 0)
        if reserved > kept + RELEASE_MARGIN_BYTES:
            self._torch.cuda.empty_cache()

    def _empty_cache(self) -> None:
        if self.on_gpu:
            self._torch.cuda.empty_cache()


def _each(
    one: Callable[[Any], Any], items: list[Any], left: Callable[[Any], bool] | None = None
) -> list[Any]:
    """Each item scored on its own, in order; one whose caller left is not (`ClientGone`)."""
    return [
        ClientGone(LEFT_BEFORE_FORWARD) if left is not None and left(item) else one(item)
        for item in items
    ]
