"""A rendered prompt cut in three at the template's added tokens, so caller text is encoded apart.

`cut_prompt` cuts a prompt around its user message into `Pieces`: a head and a tail that hold
only the template's text, and the body between them, which holds the caller's. `Layout` is how
a call's prompts are encoded from their pieces and put back together. Which prompts are cut, and
which caller text is refused instead, is `prompt.layout`'s decision.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from semif_serve.scoring.added_tokens import AddedTokens, last_end


@dataclass(frozen=True)
class Pieces:
    """A rendered prompt in three. `head`: the template's text up to and including its last added
    token before the user message ("" when none); `tail`: the template's text from its first
    added token after the message; `body`: what lies between, the message and the template's
    text around it. Only the body holds caller text. `Pieces("", text, "")`: a whole prompt."""

    head: str
    body: str
    tail: str


@dataclass(frozen=True)
class Layout:
    """How a call's rendered prompts are encoded: prompt i is `pieces[i]`, its head and tail
    encoded by the tokenizer (`outer` holds their ids), its body by `encoder`: the tokenizer's
    `PlainText`, or the tokenizer itself where every prompt is encoded whole."""

    encoder: Any
    pieces: list[Pieces]
    outer: dict[str, list[int]]

    @property
    def bodies(self) -> list[str]:
        return [pieces.body for pieces in self.pieces]

    def join(self, body_ids: list[list[int]]) -> list[list[int]]:
        """Each prompt's token ids, given its body's."""
        outer = self.outer
        return [
            outer[pieces.head] + ids + outer[pieces.tail]
            for pieces, ids in zip(self.pieces, body_ids)
        ]

    def ends(self, body_ids: list[list[int]]) -> tuple[list[str], list[list[int]]]:
        """What each prompt's answer letter follows, and its ids: its tail (which begins at an
        added token, so the letter cannot reach past it), or its body when it is whole."""
        texts, ids = [], []
        for pieces, body in zip(self.pieces, body_ids):
            texts.append(pieces.tail or pieces.body)
            ids.append(self.outer[pieces.tail] if pieces.tail else body)
        return texts, ids


def cut_prompt(
    text: str, message: str, added: AddedTokens, head_ends: dict[str, int | None] | None = None
) -> Pieces | None:
    """`text` as `Pieces` around its one copy of `message`. None when the message is not there
    exactly once, an added token's text runs over either end of it, the last added token before
    it overlaps another (`tail_start`: the tokenizer might cut out the other one), or no added
    token follows it (the answer letter would follow caller text). `head_ends` memoizes where
    the last added token of a head ends."""
    start = text.find(message)
    if start < 0 or text.find(message, start + 1) >= 0:
        return None
    end = start + len(message)
    if _crosses(text, start, added) or _crosses(text, end, added):
        return None
    head = text[:start]
    head_ends = {} if head_ends is None else head_ends
    if head not in head_ends:
        head_ends[head] = last_end(head, added)
    follows = added.starts.search(text, end)
    if head_ends[head] is None or follows is None:
        return None
    head_end, tail_begin = head_ends[head], follows.start()
    return Pieces(text[:head_end], text[head_end:tail_begin], text[tail_begin:])


def _crosses(text: str, position: int, added: AddedTokens) -> bool:
    """Whether an added token's text starts before `position` and ends after it."""
    begin = max(0, position - added.longest + 1)
    for match in added.starts.finditer(text, begin, position + added.longest - 1):
        if match.start() >= position:
            return False
        if match.start() + len(match.group(1)) > position:
            return True
    return False
