"""Memory honestly bounded (issue 22): stored state prefixes live in memory mappings of their own,
which go back to the system with their last tensor; the worker's threads share
`native_memory.ARENAS` malloc heaps from its start; `release_over` trims glibc's heaps only past
baseline + held + margin. The C library is faked where a call's effect is the point; a few
checks run against this machine's glibc."""

from __future__ import annotations

import gc
import json
import mmap
import subprocess
import sys
import weakref

import pytest
import torch
from prefix_fixtures import resume_once
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from semif_serve import server
from semif_serve.config import Settings
from semif_serve.engine import native_memory
from semif_serve.scoring import cache as cache_module
from semif_serve.scoring import prefix_cache as prefix_cache_module
from semif_serve.scoring.cache import MAPPING_ALIGNMENT, cache_bytes, move_to_own_mapping
from semif_serve.scoring.prefix_cache import PrefixCache

MODEL = ("source", "test")


class FakeLibc:
    """glibc's mallopt and malloc_trim, recorded; `glibc=False` is a C library without them."""

    def __init__(self, glibc: bool = True, answer: int = 1):
        self.calls: list[tuple] = []
        self.answer = answer
        if glibc:
            self.mallopt = lambda param, value: self._called("mallopt", param, value)
            self.malloc_trim = lambda pad: self._called("malloc_trim", pad)

    def _called(self, *call) -> int:
        self.calls.append(call)
        return self.answer


@pytest.fixture
def libc(monkeypatch):
    fake = FakeLibc()
    monkeypatch.setattr(native_memory, "_libc", lambda: fake)
    return fake


class RecordedMapping(mmap.mmap):
    """An mmap.mmap whose instances the test can watch go (weak references)."""

    made: list[weakref.ref] = []

    def __new__(cls, *args, **kwargs):
        mapping = super().__new__(cls, *args, **kwargs)
        cls.made.append(weakref.ref(mapping))
        return mapping


@pytest.fixture
def mappings(monkeypatch) -> list[weakref.ref]:
    RecordedMapping.made = []
    monkeypatch.setattr(cache_module.mmap, "mmap", RecordedMapping)
    return RecordedMapping.made


def attention_prefix(tokens: int = 5) -> DynamicCache:
    """Two attention layers (the second float16), as a prefill leaves them."""
    cache = DynamicCache()
    first, second = DynamicLayer(), DynamicLayer()
    first.update(
        torch.arange(2.0 * tokens * 3).reshape(1, 2, tokens, 3), -torch.ones(1, 2, tokens, 3)
    )
    second.update(
        torch.full((1, 1, tokens, 3), 0.5).half(), torch.full((1, 1, tokens, 3), 2.0).half()
    )
    cache.layers = [first, second]
    return cache


def hybrid_prefix() -> DynamicCache:
    """An attention layer and a linear-attention layer with a conv state, a recurrent state and
    a conv state never set."""
    cache = attention_prefix()
    linear = LinearAttentionLayer(number_of_states=2)
    linear.conv_states[0] = torch.arange(24.0).reshape(1, 8, 3)
    linear.recurrent_states[0] = torch.full((1, 2, 4, 4), 3.0)
    linear.recurrent_states[1] = torch.full((1, 4, 4), 4.0)
    cache.layers = [cache.layers[0], linear]
    return cache


def tensors(cache: DynamicCache) -> list:
    return [home[name] for home, name in cache_module._homes(cache)]


# -- stored prefixes in mappings of their own ----------------------------------------------------


def test_layout_aligns_every_tensor():
    assert cache_module._layout([]) == ([], 0)
    assert cache_module._layout([10, 64, 1, 0, 65]) == ([0, 64, 128, 192, 192], 257)
    assert cache_module._layout([64, 64]) == ([0, 64], 128)


@pytest.mark.parametrize("build", [attention_prefix, hybrid_prefix])
def test_a_moved_cache_holds_the_same_tensors_in_one_mapping(build, mappings):
    cache, reference = build(), build()
    before = [tensor.data_ptr() for tensor in tensors(cache) if tensor is not None]
    size = move_to_own_mapping(cache)
    moved = [tensor for tensor in tensors(cache) if tensor is not None]
    assert len(mappings) == 1 and mappings[0]() is not None
    assert cache_bytes(cache) == cache_bytes(reference)
    for tensor, expected in zip(tensors(cache), tensors(reference), strict=True):
        if expected is None:
            assert tensor is None
        else:
            assert tensor.dtype == expected.dtype and torch.equal(tensor, expected)
    pointers = [tensor.data_ptr() for tensor in moved]
    start = pointers[0]
    assert not set(pointers) & set(before)  # copies, not the prefill's own memory
    offsets = [pointer - start for pointer in pointers]
    assert offsets == cache_module._layout([tensor.nbytes for tensor in moved])[0]
    assert all(offset % MAPPING_ALIGNMENT == 0 for offset in offsets)
    assert size == offsets[-1] + moved[-1].nbytes == len(mappings[0]())


def test_the_mapping_goes_with_its_last_tensor(mappings):
    cache = attention_prefix()
    move_to_own_mapping(cache)
    keys = cache.layers[0].keys
    del cache
    gc.collect()
    assert mappings[0]() is not None  # a call still uses one of its tensors
    assert torch.equal(keys, attention_prefix().layers[0].keys)
    del keys
    gc.collect()
    assert mappings[0]() is None


def test_tensors_off_the_cpu_stay_where_they_are(mappings):
    cache = attention_prefix()
    meta = torch.empty((1, 2, 5, 3), device="meta")
    cache.layers[0].keys = meta
    move_to_own_mapping(cache)
    assert cache.layers[0].keys is meta
    assert len(mappings) == 1 and cache.layers[0].values.data_ptr() % MAPPING_ALIGNMENT == 0
    every = DynamicCache()
    every.layers = [DynamicLayer()]
    every.layers[0].keys = every.layers[0].values = meta
    assert move_to_own_mapping(every) == 0 and len(mappings) == 1  # nothing on the CPU: no mapping


def test_without_a_mapping_the_tensors_stay(monkeypatch):
    def refused(*args, **kwargs):
        raise OSError(12, "Cannot allocate memory")

    monkeypatch.setattr(cache_module.mmap, "mmap", refused)
    cache = attention_prefix()
    before = tensors(cache)
    assert move_to_own_mapping(cache) == 0
    assert all(now is then for now, then in zip(tensors(cache), before, strict=True))


def test_a_stored_prefix_lives_in_its_own_mapping_and_goes_when_evicted(mappings):
    cache = PrefixCache(cache_bytes(attention_prefix()), min_tokens=1)
    with resume_once(cache, MODEL, [1], attention_prefix) as (resumed, hit, stored):
        assert not hit and stored and len(mappings) == 1
        [(_, entry)] = cache._entries.items()
        assert resumed.layers[0].keys is entry.cache.layers[0].keys  # the working copy shares it
    del resumed, entry
    with resume_once(cache, MODEL, [2], attention_prefix) as (_, hit, stored):  # evicts [1]
        assert not hit and stored
    gc.collect()
    assert [mapping() is None for mapping in mappings] == [True, False]


def test_a_prefill_larger_than_the_budget_is_not_copied(monkeypatch):
    moved = []
    monkeypatch.setattr(prefix_cache_module, "move_to_own_mapping", moved.append)
    entry = cache_bytes(attention_prefix())
    with resume_once(PrefixCache(entry - 1, min_tokens=1), MODEL, [1], attention_prefix):
        pass
    assert moved == []
    with resume_once(PrefixCache(entry, min_tokens=1), MODEL, [1], attention_prefix):
        pass
    assert len(moved) == 1


# -- the worker's malloc heaps -------------------------------------------------------------------


def test_limit_arenas_sets_glibcs_arena_maximum(libc):
    assert native_memory.limit_arenas() is True
    assert native_memory.limit_arenas(5) is True
    assert libc.calls == [("mallopt", -8, native_memory.ARENAS), ("mallopt", -8, 5)]
    libc.answer = 0  # glibc refused the value
    assert native_memory.limit_arenas() is False


def test_trim_hands_every_heaps_free_pages_back(libc):
    assert native_memory.trim() is True
    libc.answer = 0  # nothing could be released
    assert native_memory.trim() is False
    assert libc.calls == [("malloc_trim", 0), ("malloc_trim", 0)]


def test_release_over_trims_only_past_baseline_held_and_margin(libc, monkeypatch):
    monkeypatch.setattr(native_memory, "resident_bytes", lambda: 1000)
    margin = native_memory.RELEASE_MARGIN_BYTES
    assert native_memory.release_over(None, 0) is False  # no baseline recorded
    assert native_memory.release_over(1000 - margin - 300, 300) is False  # exactly at the bound
    assert libc.calls == []
    assert native_memory.release_over(1000 - margin - 300, 299) is True  # one byte over
    assert libc.calls == [("malloc_trim", 0)]
    assert native_memory.release_over(900, 50, margin=49) is True
    assert native_memory.release_over(900, 50, margin=50) is False
    assert len(libc.calls) == 2
    monkeypatch.setattr(native_memory, "resident_bytes", lambda: None)  # no /proc
    assert native_memory.release_over(0, 0) is False and len(libc.calls) == 2


def test_without_glibc_nothing_is_called(monkeypatch):
    fake = FakeLibc(glibc=False)
    monkeypatch.setattr(native_memory, "_libc", lambda: fake)
    assert native_memory.limit_arenas() is False
    assert native_memory.trim() is False
    monkeypatch.setattr(native_memory, "_libc", lambda: None)  # ctypes could not open it
    assert native_memory.limit_arenas() is False and native_memory.trim() is False


RESIDENT_SCRIPT = """
from semif_serve.engine import native_memory
before = native_memory.resident_bytes()
block = b"\\x01" * (64 << 20)  # written: every page touched
print(before, native_memory.resident_bytes())
"""


def test_resident_bytes_follow_touched_memory():
    # A fresh process: a long test process may hand the block pages it already holds.
    done = subprocess.run(
        [sys.executable, "-c", RESIDENT_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    before, grown = map(int, done.stdout.split())
    assert before > 0 and grown - before >= 48 << 20


def test_this_machines_glibc_takes_both_calls():
    if native_memory._function("malloc_trim") is None:
        pytest.skip("not glibc")
    assert native_memory.limit_arenas(8 * 64) is True  # glibc's own ceiling: changes nothing
    assert native_memory.trim() in (True, False)


HEAP_SCRIPT = """
import ctypes, json
from semif_serve.engine import native_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt(-3, 64 << 20)  # M_MMAP_THRESHOLD: 1 MiB blocks come from the heap, as tensors do
blocks, pins = [], []
for _ in range(128):  # each block followed by a small live one, as a call's tensors are by
    blocks.append(libc.malloc(1 << 20))  # the objects that outlive it
    pins.append(libc.malloc(4096))
    ctypes.memset(blocks[-1], 1, 1 << 20)
full = native_memory.resident_bytes()
for block in blocks:
    libc.free(block)
freed = native_memory.resident_bytes()
trimmed = native_memory.trim()
print(json.dumps([full, freed, native_memory.resident_bytes(), trimmed]))
"""


def test_trim_returns_freed_heap_blocks_that_free_alone_keeps():
    """The mechanism on this machine's glibc: 128 MiB of 1 MiB blocks freed between live blocks
    stay resident until `trim`."""
    if native_memory._function("malloc_trim") is None:
        pytest.skip("not glibc")
    done = subprocess.run(
        [sys.executable, "-c", HEAP_SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    full, freed, trimmed, released = json.loads(done.stdout)
    assert freed > full - (16 << 20)  # free() handed back almost nothing
    assert freed - trimmed > 100 << 20 and released is True


def test_the_worker_limits_its_heaps_when_it_starts(monkeypatch):
    events = []
    monkeypatch.setattr(native_memory, "limit_arenas", lambda: events.append("arenas"))
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.tcache_count=0")

    class Worker:
        def configure(self, limits):
            events.append(limits)

    settings = Settings.from_env({"SEMIF_API_TOKEN": "t" * 40})
    server.gunicorn_options(settings)["post_fork"](object(), Worker())
    assert events[0] == "arenas" and len(events) == 2
    assert events[1].header_timeout_s == settings.header_timeout_s


@pytest.mark.parametrize(
    "environ",
    [{"MALLOC_ARENA_MAX": "8"}, {"GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}],
)
def test_the_operators_arena_maximum_wins(monkeypatch, environ):
    monkeypatch.setattr(native_memory, "limit_arenas", lambda: pytest.fail("overrode it"))
    configured = []

    class Worker:
        def configure(self, limits):
            configured.append(limits)

    server.start_worker(Worker(), "limits", environ)
    assert configured == ["limits"]
