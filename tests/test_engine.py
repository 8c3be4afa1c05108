"""The engine's lock and memory policy against a fake torch (contract INV-2, INV-4; C4, C5, S9)."""

import logging
import threading

import pytest
from fake_torch import GIB, MIB, FakeTorch
from fakes import WAIT_S, FakeScorer
from rows_factory import make_rows
from runtime_fixtures import Background

from semif_serve.engine.engine import (
    EMPTY_OOM_MESSAGE,
    RELEASE_MARGIN_BYTES,
    Engine,
    is_out_of_memory,
)
from semif_serve.errors import ClientGone, OutOfMemory, ScoringFailed
from semif_serve.scoring import parse_row
from semif_serve.scoring.rows import RowError

ROW = parse_row(
    {
        "id": "a",
        "state": "s",
        "question": "q",
        "options": [{"id": "y", "description": "Y"}, {"id": "n", "description": "N"}],
    }
)


class HoldingScorer(FakeScorer):
    """Holds a fake tensor in its frame (and optionally in a reference cycle), then fails."""

    def __init__(self, torch, error_factory, cycle=False):
        super().__init__()
        self.torch = torch
        self.error_factory = error_factory
        self.cycle = cycle

    def score(self, row):
        tensor = self.torch.cuda.hold()
        if self.cycle:
            tensor.myself = tensor  # only gc.collect() frees this one
        raise self.error_factory(self.torch)


def gpu_engine(scorer, torch):
    engine = Engine(scorer, device="cuda", torch_module=torch)
    engine.record_baseline()
    return engine


@pytest.mark.parametrize(
    "make_error",
    [
        lambda torch: torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        lambda torch: RuntimeError("CUBLAS_STATUS_ALLOC_FAILED: cuBLAS out of memory"),
        lambda torch: RuntimeError("CUDA error: out of memory"),
    ],
)
@pytest.mark.parametrize("cycle", [False, True])
def test_out_of_memory_is_unchained_and_the_cache_is_emptied_after_the_tensors_are_freed(
    make_error, cycle
):
    torch = FakeTorch()
    engine = gpu_engine(HoldingScorer(torch, make_error, cycle), torch)
    with pytest.raises(OutOfMemory, match="out of memory") as caught:
        engine.score(ROW)
    assert caught.value.__context__ is None and caught.value.__cause__ is None
    assert torch.cuda.empty_cache_calls == [True]


def test_an_out_of_memory_error_with_no_message_is_reported_as_cuda_out_of_memory():
    torch = FakeTorch()
    engine = gpu_engine(HoldingScorer(torch, lambda t: t.cuda.OutOfMemoryError()), torch)
    with pytest.raises(OutOfMemory) as caught:
        engine.score(ROW)
    assert str(caught.value) == EMPTY_OOM_MESSAGE


@pytest.mark.parametrize("cycle", [False, True])
def test_other_failures_are_logged_then_unchained_scoring_failed_after_gc_and_empty_cache(
    caplog, cycle
):
    torch = FakeTorch()
    engine = gpu_engine(HoldingScorer(torch, lambda t: KeyError("kernel state"), cycle), torch)
    with pytest.raises(ScoringFailed, match="scoring failed: KeyError") as caught:
        engine.score(ROW)
    assert caught.value.__context__ is None and caught.value.__cause__ is None
    assert torch.cuda.empty_cache_calls == [True]
    assert "Traceback" in caplog.text and "kernel state" in caplog.text


def test_an_empty_runtime_error_is_a_scoring_failure_not_an_oom():
    torch = FakeTorch()
    engine = gpu_engine(HoldingScorer(torch, lambda t: RuntimeError()), torch)
    with pytest.raises(ScoringFailed):
        engine.score(ROW)


def test_row_refusals_pass_through_untouched_and_release_nothing():
    torch = FakeTorch()
    error = RowError("options: bad")
    with pytest.raises(RowError) as caught:
        gpu_engine(FakeScorer(error=error), torch).score(ROW)
    assert caught.value is error
    assert torch.cuda.empty_cache_calls == []


def test_a_value_error_from_torch_is_a_logged_scoring_failure_not_the_callers(caplog):
    torch = FakeTorch()
    error = ValueError("Expected input batch_size (1) to match target batch_size (2)")
    with caplog.at_level(logging.ERROR), pytest.raises(ScoringFailed) as caught:
        gpu_engine(FakeScorer(error=error), torch).score(ROW)
    assert str(caught.value) == (
        "scoring failed: ValueError: Expected input batch_size (1) to match target batch_size (2)"
    )
    logged = [record.getMessage() for record in caplog.records]
    assert len(logged) == 1 and "Traceback" in logged[0] and "batch_size" in logged[0]
    assert torch.cuda.empty_cache_calls != []  # released like any failed call


@pytest.mark.parametrize(
    "message",
    [
        "DefaultCPUAllocator: can't allocate memory: you tried to allocate 9663676416 bytes",
        "CUDA out of memory. Tried to allocate 2.00 GiB",
        "CUBLAS_STATUS_ALLOC_FAILED: Out Of Memory",
    ],
)
def test_allocation_failures_are_out_of_memory_on_the_cpu_and_the_gpu(message):
    assert is_out_of_memory(RuntimeError(message), FakeTorch())
    assert not is_out_of_memory(ValueError(message), FakeTorch())  # only RuntimeErrors say so


class Grows(FakeScorer):
    """Each call leaves `reserved` at `after` bytes."""

    def __init__(self, torch, after):
        super().__init__()
        self.torch, self.after = torch, after

    def score_shared(self, rows):
        self.torch.cuda.reserved = self.after
        return super().score_shared(rows)


@pytest.mark.parametrize(
    ("growth", "released"),
    [(0, False), (RELEASE_MARGIN_BYTES, False), (RELEASE_MARGIN_BYTES + 1, True), (3 * GIB, True)],
)
def test_after_a_call_memory_over_baseline_plus_512_mib_is_released_and_not_otherwise(
    growth, released
):
    torch = FakeTorch()
    torch.cuda.reserved = 7 * GIB
    scorer = Grows(torch, 7 * GIB + growth)
    engine = gpu_engine(scorer, torch)
    assert engine.baseline_reserved == 7 * GIB
    engine.score_shared([ROW])
    assert torch.cuda.empty_cache_calls == ([True] if released else [])
    assert RELEASE_MARGIN_BYTES == 512 * MIB


class Holding(Grows):
    """A scorer whose state-prefix cache keeps `held` bytes between calls."""

    def __init__(self, torch, after, held):
        super().__init__(torch, after)
        self.held, self.closed = held, 0

    def held_bytes(self):
        return self.held

    def close(self):
        self.closed += 1


@pytest.mark.parametrize(
    ("growth", "released"),
    [(2 * GIB + RELEASE_MARGIN_BYTES, False), (2 * GIB + RELEASE_MARGIN_BYTES + 1, True)],
)
def test_bytes_the_prefix_cache_keeps_are_not_released_after_a_call(growth, released):
    torch = FakeTorch()
    torch.cuda.reserved = 7 * GIB
    engine = gpu_engine(Holding(torch, 7 * GIB + growth, held=2 * GIB), torch)
    engine.score_shared([ROW])
    assert torch.cuda.empty_cache_calls == ([True] if released else [])


def test_closing_the_engine_closes_its_scorer_once_and_then_serves_nothing():
    torch = FakeTorch()
    scorer = Holding(torch, 0, held=0)
    scorer.cache = {"hits": 1, "misses": 0, "evictions": 0, "bytes": 0, "entries": 0}
    engine = gpu_engine(scorer, torch)
    assert engine.cache_stats() == scorer.cache
    engine.close()
    assert scorer.closed == 1 and engine.cache_stats() is None
    assert torch.cuda.empty_cache_calls  # the memory went back too


def test_the_cpu_engine_maps_oom_but_never_touches_cuda():
    class NoCuda:
        OutOfMemoryError = FakeTorch.OutOfMemoryError

        @property
        def cuda(self):
            raise AssertionError("the CPU engine called torch.cuda")

    torch = FakeTorch()
    engine = Engine(
        HoldingScorer(torch, lambda t: t.OutOfMemoryError("oom")),
        device="cpu",
        torch_module=NoCuda(),
    )
    engine.record_baseline()
    with pytest.raises(OutOfMemory):
        engine.score(ROW)
    assert engine.baseline_reserved is None


def test_the_lock_is_released_after_a_failure_and_calls_never_overlap():
    scorer = FakeScorer(error=RuntimeError("once"))
    engine = Engine(scorer)
    with pytest.raises(ScoringFailed):
        engine.score(ROW)
    scorer.error = None
    assert engine.score(ROW)["id"] == "a"
    assert scorer.max_active == 1


class DeviceRecordingTorch(FakeTorch):
    """Records which device every memory query named."""

    def __init__(self):
        super().__init__()
        self.queried = []
        measure = self.cuda.memory_reserved

        def memory_reserved(device=None):
            self.queried.append(device)
            return measure(device)

        self.cuda.memory_reserved = memory_reserved


def test_memory_is_measured_on_the_engine_s_own_device():
    torch = DeviceRecordingTorch()
    engine = Engine(FakeScorer(), device="cuda:1", torch_module=torch)
    engine.record_baseline()
    engine.score(ROW)
    assert torch.queried == ["cuda:1", "cuda:1"]


def test_an_oom_logs_one_warning_with_the_first_line_of_its_message(caplog):
    torch = FakeTorch()
    message = "CUDA out of memory. Tried to allocate 2.00 GiB\nsee the allocator docs"
    engine = gpu_engine(HoldingScorer(torch, lambda t: t.cuda.OutOfMemoryError(message)), torch)
    with pytest.raises(OutOfMemory):
        engine.score(ROW)
    assert [r.getMessage() for r in caplog.records] == [
        "out of memory during scoring: CUDA out of memory. Tried to allocate 2.00 GiB"
    ]


def test_a_failure_logs_its_whole_traceback_as_text(caplog):
    import traceback

    raised = []

    def failure(torch):
        raised.append(KeyError("kernel state"))
        return raised[0]

    torch = FakeTorch()
    engine = gpu_engine(HoldingScorer(torch, failure), torch)
    with pytest.raises(ScoringFailed, match=r"^scoring failed: KeyError: 'kernel state'$"):
        engine.score(ROW)
    [record] = caplog.records
    expected = "".join(traceback.format_exception(raised[0])).rstrip()
    assert record.getMessage() == "scorer call failed:\n" + expected
    assert expected.startswith("Traceback") and record.exc_info is None


class ContendedSemaphore(threading.BoundedSemaphore):
    """A semaphore that says when a caller found it taken and had to wait."""

    def __init__(self, value=1):
        super().__init__(value)
        self.contended = threading.Event()

    def acquire(self, blocking=True, timeout=None):
        if super().acquire(blocking=False):
            return True
        self.contended.set()
        return super().acquire(blocking, timeout)

    __enter__ = acquire


def test_two_threads_never_run_the_scorer_at_once_by_default(monkeypatch):
    scorer = FakeScorer(block=True)
    monkeypatch.setattr(threading, "BoundedSemaphore", ContendedSemaphore)
    engine = Engine(scorer)  # its own lock, the default
    monkeypatch.undo()
    first = Background(lambda: engine.score(ROW))
    assert scorer.entered.wait(WAIT_S)
    scorer.entered.clear()
    second = Background(lambda: engine.score(ROW))
    # The second call waits at the engine's lock while the first is inside the scorer.
    assert engine._lock.contended.wait(WAIT_S), "the second call never waited for the first"
    assert not scorer.entered.is_set(), "a second call entered the scorer while one ran"
    scorer.release.set()
    first.result(), second.result()
    assert scorer.max_active == 1 and len(scorer.calls) == 2


def test_a_scorer_without_a_batch_step_skips_an_item_whose_caller_left():
    scorer = FakeScorer()
    engine = Engine(scorer)
    rows = [parse_row(row) for row in make_rows(2, 2)]
    outcomes = engine.score_batch(rows, left=lambda row: row is rows[1])
    assert outcomes[0].outcome["id"] == rows[0].id
    assert isinstance(outcomes[1], ClientGone)
    assert scorer.calls == [("score", rows[0])]
