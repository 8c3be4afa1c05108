"""Issue 22, finding 4: an out-of-memory error costs only the failing model's stored prefixes,
oldest first and only as many as cover what the allocation lacked, and is retried once only when
that drop freed enough; a request that cannot fit even with an empty cache is a 503 at once.
The policy's arithmetic (`oom_policy`) and TorchScorer's use of it, over a fake model and cache.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from fake_torch import FakeTorch

from semif_serve.engine.engine import Engine
from semif_serve.engine.oom_policy import bytes_to_drop, ran_out_of_memory, relieved, shortfall
from semif_serve.engine.torch_scorer import TorchScorer
from semif_serve.errors import OutOfMemory, ScoringFailed

MIB = 1 << 20
CUDA_OOM = (
    "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity of 79.19 GiB of "
    "which 4.00 MiB is free. Including non-PyTorch memory, this process has 79.18 GiB in use."
)
CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: can't allocate memory: you "
    "tried to allocate 4096 bytes. Error code 12 (Cannot allocate memory)"
)


@pytest.mark.parametrize(
    ("message", "lacking"),
    [
        (CUDA_OOM, 16 * MIB),  # 20 MiB asked, 4 MiB free
        (CPU_OOM, 4096),  # no free figure: all of it
        ("CUDA out of memory. Tried to allocate 2.50 GiB. of which 3.00 GiB is free", 0),
        ("Tried to allocate 1.5 KiB", 1536),
        ("tried to allocate 7 B", 7),
        ("Tried to allocate 1 TiB", 1 << 40),
        ("CUDA out of memory", None),
        ("", None),
        ("Tried to allocate 1.2.3 MiB", None),  # not a number
        ("Tried to allocate 1e999 GiB", None),  # no such size
        ("Tried to allocate 5 MiB of which lots is free", 5 * MIB),
    ],
)
def test_the_shortfall_is_read_from_torchs_message(message, lacking):
    assert shortfall(message) == lacking


@pytest.mark.parametrize(
    ("stored", "lacking", "dropped"),
    [
        (0, None, None),  # nothing stored: nothing to drop, a 503 at once
        (0, 10, None),
        (1, None, 1),  # one byte stored is something to drop
        (100, None, 100),  # an unknown shortfall: drop them all, once
        (100, 60, 60),  # only what covers the shortfall
        (100, 100, 100),
        (100, 101, None),  # even an empty cache would not fit it: a 503 at once
        (100, 0, 1),  # fragmentation: drop one entry at least
    ],
)
def test_what_to_drop(stored, lacking, dropped):
    assert bytes_to_drop(stored, lacking) == dropped


class FakeModelCache:
    """A model's prefix-cache view: `stored` bytes in entries of `entry` bytes, oldest first."""

    def __init__(self, stored, entry=10, pinned=0):
        self.stored, self.entry, self.pinned = stored, entry, pinned
        self.drops: list[int | None] = []

    def stats(self):
        return {"bytes": self.stored}

    def drop(self, at_least=None):
        self.drops.append(at_least)
        freed = 0
        while self.stored - self.pinned > 0 and freed < at_least:
            freed += self.entry
            self.stored -= self.entry
        return freed


def scorer(cache, device="cuda:0"):
    made = TorchScorer.__new__(TorchScorer)
    info = SimpleNamespace(device=device)
    made.scoring_model = SimpleNamespace(info=info)
    made.max_tokens = 4096
    made.prefix_cache = cache
    made._torch = FakeTorch()
    return made


class Calls:
    """A scorer call that runs out of memory `failures` times (message `message`) first."""

    def __init__(self, failures, message=CUDA_OOM, error=None):
        self.failures, self.message, self.error = failures, message, error
        self.caches: list[object] = []

    def __call__(self, cache):
        self.caches.append(cache)
        if len(self.caches) <= self.failures:
            raise self.error or RuntimeError(self.message)
        return "scored"


def scored(made, call, method="score"):
    """`call` as the scorer's one call `method` (with its cache, or None on the policy's retry:
    `cached=False`, a bool and nothing else), through the engine's policy: its error handling,
    then `oom_policy.relieved` with `made.relieve`."""

    def score(argument, cached=True):
        return call({True: made.prefix_cache, False: None}.get(cached, "cached is not a bool"))

    setattr(made, method, score)
    device = made.scoring_model.info.device
    return getattr(Engine(made, device=device, torch_module=made._torch), method)("a row")


def drops_logged(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "semif_serve.engine.torch_scorer"]


@pytest.mark.parametrize("method", ["score", "score_shared"])
def test_an_oom_drops_only_what_covers_the_shortfall_and_retries_without_the_cache(caplog, method):
    cache = FakeModelCache(stored=100 * MIB, entry=10 * MIB)
    made, call = scorer(cache), Calls(1)
    with caplog.at_level(logging.WARNING):
        assert scored(made, call, method) == "scored"
    assert cache.drops == [16 * MIB] and cache.stored == 80 * MIB  # two entries of ten
    assert call.caches == [cache, None]
    # handed back twice before the second try: by the engine after the failed call, then by
    # the scorer once the dropped prefixes are unreachable
    assert len(made._torch.cuda.empty_cache_calls) == 2
    assert drops_logged(caplog) == [
        f"out of memory ({CUDA_OOM}): dropped 20971520 of this model's 104857600 stored prefix "
        "bytes, scoring again without the prefix cache"
    ]


def test_an_oom_with_no_message_drops_the_models_prefixes_once(caplog):
    cache = FakeModelCache(stored=30, entry=10)
    with caplog.at_level(logging.WARNING):
        empty = Calls(1, error=FakeTorch.OutOfMemoryError("  "))  # torch's type, no message
        assert scored(scorer(cache), empty) == "scored"
    assert cache.drops == [30]
    assert drops_logged(caplog) == [
        "out of memory (CUDA out of memory): dropped 30 of this model's 30 stored prefix bytes, "
        "scoring again without the prefix cache"
    ]


def test_torchs_own_out_of_memory_type_is_recognised_whatever_its_message():
    cache = FakeModelCache(stored=100 * MIB)
    error = FakeTorch.OutOfMemoryError("Tried to allocate 1.00 MiB")
    assert scored(scorer(cache), Calls(1, error=error)) == "scored"
    assert cache.drops == [1 * MIB]


def test_an_oom_bigger_than_the_models_cache_is_a_503_at_once_and_drops_nothing():
    cache = FakeModelCache(stored=10 * MIB)
    made, call = scorer(cache), Calls(1)
    with pytest.raises(OutOfMemory) as caught:
        scored(made, call)
    assert str(caught.value) == CUDA_OOM
    assert cache.drops == [] and call.caches == [cache]


def test_an_oom_with_nothing_stored_is_a_503_at_once():
    cache = FakeModelCache(stored=0)
    call = Calls(1, message=CPU_OOM)
    with pytest.raises(OutOfMemory, match="can't allocate memory"):
        scored(scorer(cache, device="cpu"), call)
    assert cache.drops == [] and call.caches == [cache]


def test_a_drop_that_freed_too_little_is_not_retried():
    cache = FakeModelCache(stored=100 * MIB, entry=10 * MIB, pinned=90 * MIB)  # held by others
    call = Calls(1)
    with pytest.raises(OutOfMemory) as caught:
        scored(scorer(cache), call)
    assert str(caught.value) == CUDA_OOM
    assert cache.drops == [16 * MIB] and call.caches == [cache]


def test_a_second_oom_is_a_503():
    cache = FakeModelCache(stored=100 * MIB)
    call = Calls(2, message="CUDA out of memory")
    with pytest.raises(OutOfMemory, match="CUDA out of memory"):
        scored(scorer(cache), call)
    assert cache.drops == [100 * MIB] and call.caches == [cache, None]


def test_other_errors_and_a_model_without_a_cache_pass_through():
    with pytest.raises(ScoringFailed, match="ValueError: bug"):
        scored(scorer(FakeModelCache(stored=100)), Calls(1, error=ValueError("bug")))
    call = Calls(1)
    with pytest.raises(OutOfMemory, match="out of memory"):
        scored(scorer(None), call)
    assert call.caches == [None]  # no cache: no second try


def test_a_cpu_model_hands_nothing_back_to_a_gpu():
    cache = FakeModelCache(stored=100 * MIB, entry=MIB)
    made = scorer(cache, device="cpu")
    assert scored(made, Calls(1, message=CPU_OOM)) == "scored"
    assert made._torch.cuda.empty_cache_calls == []


def test_relieved_runs_once_more_with_cached_false_only_after_a_relief():
    tries: list[object] = []

    def attempt(cached):
        tries.append(cached)
        if len(tries) == 1:
            raise OutOfMemory("CUDA out of memory")
        return "scored"

    assert relieved(attempt, lambda message: message == "CUDA out of memory") == "scored"
    assert tries == [True, False] and tries[1] is False


def test_a_warm_up_call_that_runs_out_of_memory_is_its_message_with_the_device_cache_emptied():
    fake = FakeTorch()

    def call():
        raise FakeTorch.OutOfMemoryError("  no size given  ")  # only its type says OOM

    assert ran_out_of_memory(call, fake) == "  no size given  "
    assert len(fake.cuda.empty_cache_calls) == 1
    assert ran_out_of_memory(lambda: None, fake) is None
    assert len(fake.cuda.empty_cache_calls) == 1  # a call that ran hands nothing back
    with pytest.raises(ValueError, match="bug"):
        ran_out_of_memory(lambda: int("bug"), fake)


def test_a_warm_up_out_of_memory_on_the_cpu_empties_no_device_cache():
    fake = FakeTorch(available=False)

    def call():
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory")

    assert ran_out_of_memory(call, fake) == "DefaultCPUAllocator: can't allocate memory"
    assert fake.cuda.empty_cache_calls == []


def test_a_warm_up_out_of_memory_with_a_torch_that_has_no_cuda_module_is_its_message():
    def call():
        raise MemoryError("no room")

    assert ran_out_of_memory(call, SimpleNamespace()) == "no room"
