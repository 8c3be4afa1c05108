"""The fewest tokens a text can encode to, known without encoding it: the first, cheap length check.

Encoding a prompt costs about a second per megabyte; a request far over `max_tokens` should be
refused in milliseconds. For a fast tokenizer whose every step keeps each byte of the text
(a byte-level or byte-fallback BPE, pre-tokenizers that only split), each token stands for at
most `longest` bytes of normalised text, `longest` being its longest vocabulary entry in UTF-8
(byte-level entries, one character per byte, count at least their bytes; "▁" and "<0x0A>"
count more, which only weakens the bound). Normalisation may shrink a text before that, by at
most `shrink` (NFC composes three 3-byte Hangul jamo into one syllable; NFKC maps the 4-byte
mathematical letters to ASCII). So a text of b bytes has at least ceil(b / (longest × shrink))
tokens. A tokenizer with any step that may drop or shrink text further (strip, strip accents,
whitespace splitting, a regex replace, an unknown token covering a word, unknown kinds) has no
bound (None): its prompts are only counted exactly.
"""

from __future__ import annotations

import json
import math
import weakref
from typing import Any

# How far each normaliser may shrink a text's UTF-8 bytes (see the module docstring).
SHRINK = {
    "NFC": 3,
    "NFD": 3,
    "NFKC": 4,
    "NFKD": 4,
    "Lowercase": 3,  # the Kelvin sign (3 bytes) becomes "k"
    "Prepend": 1,
    "ByteLevel": 1,
}
# Pre-tokenizers that split (or map bytes to characters) and never drop text.
KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}
)

_bounds: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def bytes_per_token(tokenizer: Any) -> float | None:
    """The most UTF-8 bytes of caller text one token of `tokenizer` can stand for (None: no
    such bound can be vouched for). Computed once per tokenizer (a pass over its vocabulary)."""
    try:
        return _bounds[tokenizer]
    except KeyError:
        pass
    except TypeError:  # not weak-referenceable: computed each time
        return _bytes_per_token(tokenizer)
    bound = _bounds[tokenizer] = _bytes_per_token(tokenizer)
    return bound


def fewest_tokens(text: str, bound: float) -> int:
    """At least this many tokens encode `text`, one token standing for at most `bound` bytes."""
    return math.ceil(len(text.encode("utf-8", "surrogatepass")) / bound)


def _bytes_per_token(tokenizer: Any) -> float | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or type(backend.model).__name__ != "BPE":
        return None
    pre_tokenizer = _state(backend.pre_tokenizer)
    if not _keeps_text(pre_tokenizer):
        return None
    if not (_has_byte_level(pre_tokenizer) or backend.model.byte_fallback):
        return None  # an unknown character could become one unknown token, or none
    shrink = _shrink(_state(backend.normalizer))
    if shrink is None:
        return None
    vocabulary = backend.get_vocab(with_added_tokens=True)
    if not vocabulary:
        return None
    return max(len(entry.encode()) for entry in vocabulary) * shrink


def _state(component: Any) -> dict[str, Any] | None:
    """A normaliser's or pre-tokenizer's serialised form (None: there is none)."""
    return None if component is None else json.loads(component.__getstate__())


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(part) for part in pre_tokenizer["pretokenizers"])
    return kind in KEEPING_PRE_TOKENIZERS and pre_tokenizer.get("behavior") != "Removed"


def _has_byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "Sequence":
        return any(_has_byte_level(part) for part in pre_tokenizer["pretokenizers"])
    return pre_tokenizer.get("type") == "ByteLevel"


def _shrink(normalizer: dict[str, Any] | None) -> float | None:
    """How far `normalizer` may shrink a text's bytes (None: without bound)."""
    if normalizer is None:
        return 1
    kind = normalizer.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in normalizer["normalizers"]:
            factor = _shrink(part)
            if factor is None:
                return None
            total *= factor
        return total
    if kind == "Replace":
        pattern = normalizer["pattern"].get("String")
        content = normalizer["content"].encode()
        if pattern is None or not content:
            return None  # a regex, or a deletion: no bound
        return max(1, len(pattern.encode()) / len(content))
    return SHRINK.get(kind)
