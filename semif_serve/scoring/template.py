"""`TemplatePrefix`: the start every prompt of a model shares, prefilled once and kept.

Every direct-options-v1 prompt begins with the same tokens: the chat template's opening, the
system message and the user turn up to `{"evidence": ` (the caller's text starts after it).
Requests over distinct states share nothing else, so a batch of them (`coalesced`) runs as one
shared forward over this prefix: its prefill is run once per model and kept, and each row
starts after it. Splitting a forward at a token boundary changes no token's inputs, so the
results are the direct scorer's within float rounding (tests/test_exact_paths.py).

The prefix is found from the tokenizer alone: the common start of the state prefixes
(`shared_prompts`) of two probe rows whose states differ from their first character, so it ends
before anything a caller writes. A prompt is run over it only if its ids begin with it.

A `TemplatePrefix` stands where the forwards take a state-prefix cache (`prefill.prefilled`
asks it to `resume` the ids): the kept prefill is handed out as a working copy, and a call
for other ids (a prefix cut to a shape bucket) gets its own, kept too (at most MAX_KEPT).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from semif_serve.scoring.cache import cache_bytes, can_share_prefix, working_copy
from semif_serve.scoring.prefix_cache import Prefill, Reuse
from semif_serve.scoring.prompt import ChatTokenizer
from semif_serve.scoring.rows import Option, Row
from semif_serve.scoring.shared_prompts import encode_with_prefix

MIN_TOKENS = 8  # a shorter common start is not a template worth a forward of its own
MAX_KEPT = 2  # the prefix, and the bucketed cut of it a CUDA model prefills
PROBE_STATES = ("a", {"b": [1]})  # states that differ from their first character
PROBE_OPTIONS = (("yes", "Yes"), ("no", "No"))


class TemplatePrefix:
    """The shared start of a model's prompts (`ids`) and its kept prefills."""

    def __init__(self, ids: list[int]):
        self.ids = ids
        self._kept: dict[tuple[int, ...], Any] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, tokenizer: ChatTokenizer, max_tokens: int) -> TemplatePrefix | None:
        """The template prefix of prompts from `tokenizer` (None: shorter than MIN_TOKENS, a
        chat template that hides where the caller's text starts, or a tokenizer that cannot
        render the probe rows at all)."""
        starts = []
        for state in PROBE_STATES:
            options = tuple(Option(name, text) for name, text in PROBE_OPTIONS)
            row = Row(id="probe", state=state, question="probe", options=options)
            try:
                _, prefix = encode_with_prefix(tokenizer, row, max_tokens)
            except Exception:  # noqa: BLE001 - no template: every prompt runs as it did before
                return None
            if prefix is None:
                return None
            starts.append(prefix)
        common = 0
        for one, other in zip(*starts):
            if one != other:
                break
            common += 1
        return cls(starts[0][:common]) if common >= MIN_TOKENS else None

    def starts(self, ids: list[int]) -> bool:
        """Whether a prompt's `ids` begin with the prefix and go on after it."""
        return len(ids) > len(self.ids) and ids[: len(self.ids)] == self.ids

    @contextmanager
    def resume(
        self, ids: list[int], prefill: Prefill, chunk: int = 1
    ) -> Iterator[tuple[Any, Reuse]]:
        """(a cache positioned after `ids` for the caller to consume, what it reused): a working
        copy of the kept prefill of `ids`, prefilled and kept on first use, in one piece (no
        checkpoints: `chunk`, where the state-prefix cache would take them, changes nothing).
        A cache that cannot be shared (sliding-window layers: `cache.can_share_prefix`) is
        prefilled for each call and never kept, as the state-prefix cache keeps none."""
        key = tuple(ids)
        with self._lock:
            kept = self._kept.get(key)
        if kept is not None:
            yield working_copy(kept), Reuse(len(ids), "end", hit=True)
            return
        cache = prefill(None, 0, [])[0]
        if not can_share_prefix(cache):
            yield cache, Reuse()
            return
        with self._lock:
            if len(self._kept) < MAX_KEPT:
                self._kept.setdefault(key, cache)
        yield working_copy(cache), Reuse(stored=True)

    def held_bytes(self) -> int:
        """Bytes of the kept prefills."""
        with self._lock:
            return sum(cache_bytes(cache) for cache in self._kept.values())

    def drop(self) -> None:
        """Forget the kept prefills (the model is going, or memory is short)."""
        with self._lock:
            self._kept.clear()
