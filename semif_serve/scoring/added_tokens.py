"""The added tokens a fast tokenizer cuts out of any text first, and where a text's last one ends.

A fast tokenizer (HF `tokenizers`) cuts a text at each occurrence of an added token and encodes
every piece between them on its own, so the tokens of a piece depend on that piece's text only.
`added_tokens` says which strings those are, where that can be vouched for; `tail_start` and
`last_end` find the cut after a text's last occurrence. The answer-boundary guard re-encodes only
the text after that cut (`prompt.check_answer_boundary`), a prompt is cut in three at such cuts
(`pieces.cut_prompt`), and the shared scorer reuses row 0's tokens up to one (`shared_prompts`).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from typing import Any

TAIL_WINDOW = 512  # characters searched first for a prompt's last added token (found near its end)


@dataclass(frozen=True)
class AddedTokens:
    """The strings a fast tokenizer cuts out of any text as tokens of their own, first of all."""

    contents: tuple[str, ...]
    longest: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "longest", max(map(len, self.contents), default=0))

    @property
    def starts(self) -> re.Pattern:
        """Matches (empty) where a content starts; group 1: the longest content starting there."""
        return _starts_pattern(self.contents)


@functools.lru_cache(maxsize=16)
def _starts_pattern(contents: tuple[str, ...]) -> re.Pattern:
    alternatives = "|".join(map(re.escape, sorted(contents, key=len, reverse=True)))
    return re.compile(f"(?=({alternatives or '(?!)'}))")


def added_tokens(tokenizer: Any) -> AddedTokens | None:
    """The added tokens of a tokenizer whose fast backend (HF `tokenizers`) cuts the text at each
    occurrence of one, as a plain string, and then normalises, pre-tokenises and encodes every
    piece between them on its own; so the tokens of a piece depend on that piece's text only.

    None when that cannot be established: no fast backend; special tokens encoded as text; a
    token with lstrip/rstrip/single_word (its cut depends on the neighbouring text) or, under a
    normalizer, `normalized` (matched in normalised text); a Metaspace pre-tokenizer that marks
    only the text's first piece. No added token at all is `AddedTokens(())`.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "split_special_tokens", False):
        return None
    try:
        if backend.encode_special_tokens:
            return None
        tokens = list(backend.get_added_tokens_decoder().values())
        normalizer = backend.normalizer
        pre_tokenizer = backend.pre_tokenizer
        pre_state = pre_tokenizer.__getstate__() if pre_tokenizer is not None else b""
    except AttributeError:
        return None
    if b'"prepend_scheme":"first"' in pre_state:
        return None
    for token in tokens:
        if token.lstrip or token.rstrip or token.single_word or not token.content:
            return None
        if token.normalized and normalizer is not None:
            return None
    return AddedTokens(tuple(sorted({token.content for token in tokens})))


def tail_start(text: str, added: AddedTokens) -> int | None:
    """Where the text after its last added-token occurrence begins. None when none occurs, or
    when another occurrence overlaps that last one (the tokenizer's leftmost-longest matching
    might then cut out the other one instead)."""
    begin = max(0, len(text) - TAIL_WINDOW)
    last, last_content = _last_occurrence(text, added, begin)
    if begin and (last < 0 or last + len(last_content) < begin + added.longest):
        # Not found near the end: an occurrence reaching into the window may have been missed.
        last, last_content = _last_occurrence(text, added, 0)
    if last < 0:
        return None
    end = last + len(last_content)
    for content in added.contents:
        # Occurrences overlapping [last, end) start in (last - len, end); none ends after `end`.
        stop = end + len(content) - 1
        found = text.find(content, max(0, last - len(content) + 1), stop)
        while found >= 0:
            if (found, content) != (last, last_content):
                return None
            found = text.find(content, found + 1, stop)
    return end


def last_end(text: str, added: AddedTokens) -> int | None:
    """Where the last added token in `text` ends: 0 when none occurs, None when it overlaps
    another occurrence (`tail_start`)."""
    end = tail_start(text, added)
    if end is None and _last_occurrence(text, added, 0)[0] < 0:
        return 0
    return end


def _last_occurrence(text: str, added: AddedTokens, begin: int) -> tuple[int, str]:
    """(start, content) of the occurrence in text[begin:] that ends last; (-1, "") if none."""
    last, last_content = -1, ""
    for content in added.contents:
        start = text.rfind(content, begin)
        if start >= 0 and start + len(content) > last + len(last_content):
            last, last_content = start, content
    return last, last_content
