"""The shared scorer's encoding stage: rows over one exact state → prompts and the state prefix.

Every row's prompt gets exactly the token ids a full `encode` of its text gives (the direct
scorer's ids), with every direct guard. The rows' texts are equal up to where their criteria
differ, so that common text is tokenized once (`encode_common`): row 0 is encoded whole, and
every other row reuses row 0's tokens before a cut that provably ends a piece the tokenizer
encodes on its own in every row (`cut_margin`, `find_cut`), encoding only its own text after it.
Where that cannot be established, every row is encoded whole.

Caller text stays text (`prompt.layout`): the rows' texts here are the bodies of their prompts
(the user message and the template's text around it), encoded by the tokenizer's `PlainText`,
between the template's head and tail.

The state prefix is the rendered text up to and including `{"evidence": <state>`, minus its last
token, since JSON punctuation can merge with the token after it. Upstream SemIf raises when a
prompt's tokens do not start with that prefix; here the prefix backs off to the tokens every
prompt does share (a state ending in `}]}` merges further back than one token on common BPE
vocabularies). Either way each row is scored on exactly the token ids the direct scorer would see.
"""

from __future__ import annotations

import json
import unicodedata
from dataclasses import dataclass

from tokenizers import models

from semif_serve.scoring.added_tokens import added_tokens
from semif_serve.scoring.pieces import Layout
from semif_serve.scoring.prompt import (
    ChatTokenizer,
    EncodedPrompt,
    PromptRejected,
    check_fewest_tokens,
    encode,
    encode_many,
    guard_prompts,
    layout,
    render_all,
    state_head,
    user_message,
)
from semif_serve.scoring.rows import InvalidRow, Row, as_row

# Split patterns (Qwen3.5's, Qwen2's) with no lookbehind and no anchors, whose only look-ahead
# past a match's end beyond one character is over whitespace runs; see `find_cut`.
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
LOCAL_SPLITS = frozenset({QWEN35_SPLIT, QWEN2_SPLIT})
MIN_MARGIN = 8  # shared characters kept after a cut, at least (a match looks 2 past its start)


def encode_shared(
    tokenizer: ChatTokenizer, rows: list[Row | dict], max_tokens: int
) -> tuple[list[Row], list[EncodedPrompt], list[int]]:
    """(parsed rows, their prompts, the state prefix every prompt's ids begin with)."""
    parsed = check_shared_rows(_parse_rows(rows))
    users = [user_message(row) for row in parsed]
    texts = _for_rows(render_all, tokenizer, parsed, users)
    _for_rows(check_fewest_tokens, tokenizer, texts, max_tokens)
    plan = _for_rows(layout, tokenizer, parsed, texts, users)
    body_ids, cut = encode_bodies(plan, parsed[0], texts[0])
    ids = plan.join(body_ids)
    ends = plan.ends(body_ids)
    prompts = _for_rows(guard_prompts, tokenizer, parsed, texts, ids, max_tokens, ends)
    prefix_ids = state_prefix_ids(plan, parsed[0], texts[0], body_ids[0], cut)
    return parsed, prompts, shared_prefix(prefix_ids, prompts)


def encode_with_prefix(
    tokenizer: ChatTokenizer, row: Row, max_tokens: int
) -> tuple[EncodedPrompt, list[int] | None]:
    """One row's prompt, exactly as `encode_prompt` gives it (ids, guards, rejections), and its
    state prefix (None when it cannot be located), the state tokenized once for both."""
    try:
        users = [user_message(row)]
        texts = render_all(tokenizer, [row], users)
        check_fewest_tokens(tokenizer, texts, max_tokens)
        plan = layout(tokenizer, [row], texts, users)
        body_ids, cut = encode_bodies(plan, row, texts[0])
        ends = plan.ends(body_ids)
        prompt = guard_prompts(tokenizer, [row], texts, plan.join(body_ids), max_tokens, ends)[0]
    except PromptRejected as error:
        raise PromptRejected(str(error)) from None  # a direct rejection names no row index
    if state_head_end(row, texts[0]) is None:
        return prompt, None
    try:
        prefix_ids = state_prefix_ids(plan, row, texts[0], body_ids[0], cut)
        return prompt, shared_prefix(prefix_ids, [prompt])
    except PromptRejected:
        return prompt, None


def encode_bodies(plan: Layout, row: Row, text: str) -> tuple[list[list[int]], Cut | None]:
    """The token ids of every prompt's body (`encode_common`, reusing row 0's tokens up to the
    end of its state where it can) and the cut used; `row` and `text`: row 0 and its prompt."""
    head_end = state_head_end(row, text)
    bodies = plan.bodies
    limit = len(bodies[0]) if head_end is None else head_end - len(plan.pieces[0].head)
    return encode_common(plan.encoder, bodies, limit)


def _parse_rows(rows: list[Row | dict]) -> list[Row]:
    parsed = []
    for index, row in enumerate(rows):
        try:
            parsed.append(as_row(row))
        except InvalidRow as error:
            raise InvalidRow(f"rows[{index}]: {error}", row_index=index) from None
    return parsed


def check_shared_rows(rows: list[Row]) -> list[Row]:
    """At least one row, all with the exact same state, and unique ids."""
    if not rows:
        raise InvalidRow("rows: the shared scorer needs at least one row")
    state_key = rows[0].state_key
    seen: set[str] = set()
    for index, row in enumerate(rows):
        if row.state_key != state_key:
            raise InvalidRow(
                f"rows[{index}].state: differs from rows[0].state; shared rows need the exact "
                "same state",
                row_index=index,
            )
        if row.id in seen:
            raise InvalidRow(f"rows[{index}].id: duplicate id {row.id!r}", row_index=index)
        seen.add(row.id)
    return rows


def _for_rows(stage, *args):
    """Run a prompt stage over the rows; a rejection names the row as `rows[i]`."""
    try:
        return stage(*args)
    except PromptRejected as error:
        index = error.row_index
        raise PromptRejected(f"rows[{index}]: {error}", row_index=index) from None


@dataclass(frozen=True)
class Cut:
    """Row 0 cut at character `chars`, before its token `tokens`: for any text that shares row
    0's first `until` characters, its ids are row 0's first `tokens` ids + those of its text
    from `chars` on."""

    chars: int
    tokens: int
    until: int


def encode_common(
    tokenizer: ChatTokenizer, texts: list[str], limit: int
) -> tuple[list[list[int]], Cut | None]:
    """Each text's token ids, exactly as `encode` gives them, and the cut row 0's tokens were
    reused at (None: every text was encoded whole). The cut keeps a margin before `limit` and
    before the point where any two texts first differ."""
    margin = cut_margin(tokenizer)
    if margin is None:
        return encode_many(tokenizer, texts), None
    try:
        first = tokenizer(texts[0], add_special_tokens=False, return_offsets_mapping=True)
        ids0, offsets, words = list(first["input_ids"]), first["offset_mapping"], first.word_ids()
    except (ValueError, KeyError, NotImplementedError):
        return encode_many(tokenizer, texts), None
    shared = min([limit, *(common_length(texts[0], text) for text in texts[1:])])
    found = find_cut(texts[0], offsets, words, shared - margin)
    if found is not None:
        chars, tokens = found
        ends = encode_many(tokenizer, [text[chars:] for text in texts])
        if ids0[:tokens] + ends[0] == ids0:  # the cut holds for row 0 itself
            head = ids0[:tokens]
            return [ids0, *(head + end for end in ends[1:])], Cut(chars, tokens, chars + margin)
    return [ids0, *encode_many(tokenizer, texts[1:])], None


def cut_margin(tokenizer: ChatTokenizer) -> int | None:
    """How many shared characters a cut must keep after it, or None when this tokenizer's cuts
    cannot be vouched for: it needs `added_tokens` (pieces between added tokens are encoded on
    their own), BPE without dropout (tokens never cross a pre-token), no normalizer or NFC (which
    leaves a text split before an ASCII character split), and a ByteLevel pre-tokenizer behind
    GPT-2's regex or a known Split pattern, with no prefix space (`find_cut` says why)."""
    added = added_tokens(tokenizer)
    if added is None or not callable(tokenizer):
        return None
    backend = tokenizer.backend_tokenizer
    model, normalizer, pre_tokenizer = backend.model, backend.normalizer, backend.pre_tokenizer
    if not isinstance(model, models.BPE) or model.dropout not in (None, 0.0):
        return None
    if normalizer is not None and json.loads(normalizer.__getstate__()) != {"type": "NFC"}:
        return None
    if pre_tokenizer is None or not _local_pre_tokenizer(json.loads(pre_tokenizer.__getstate__())):
        return None
    return max(MIN_MARGIN, added.longest + 2)


def _local_pre_tokenizer(state: dict) -> bool:
    def byte_level(step: dict, use_regex: bool) -> bool:
        return (
            step.get("type") == "ByteLevel"
            and step.get("add_prefix_space") is False
            and step.get("use_regex") is use_regex
        )

    if byte_level(state, use_regex=True):  # GPT-2's regex (SmolLM2)
        return True
    steps = state.get("pretokenizers") if state.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return False
    split, last = steps
    return (
        split.get("type") == "Split"
        and split.get("pattern", {}).get("Regex") in LOCAL_SPLITS
        and split.get("behavior") == "Isolated"
        and split.get("invert") is False
        and byte_level(last, use_regex=False)
    )


def find_cut(text: str, offsets, words, bound: int) -> tuple[int, int] | None:
    """(c, k): the last character position c <= `bound` where row 0 can be cut, before its token
    k. Token k starts a pre-token (word) at c, the character before c is no whitespace, and
    characters c..c+2 are ASCII.

    Why that is safe for every text sharing row 0's first c + margin characters: no added token
    reaches over c (the margin exceeds the longest); NFC leaves a split before an ASCII
    character split; the pre-token ending at c is no whitespace run, so the regex matched it
    looking at most at c + 1, shared characters (ASCII, so NFC did not change them), and matches
    it the same in a text that ends at c; the next match starts at c in every text, and the
    patterns have no lookbehind; BPE never crosses a pre-token.
    """
    for index in range(len(offsets) - 1, 0, -1):
        start = offsets[index][0]
        if start > bound or start < 1 or words[index] is None or words[index] == words[index - 1]:
            continue
        after = text[start : start + 3]
        if offsets[index - 1][1] != start or len(after) != 3 or not after.isascii():
            continue
        if unicodedata.category(text[start - 1])[0] in "LMNPS":
            return start, index
    return None


def common_length(left: str, right: str) -> int:
    """How many leading characters two texts share (binary search over C-speed comparisons)."""
    low, high = 0, min(len(left), len(right))
    while low < high:
        middle = (low + high + 1) // 2
        if left[:middle] == right[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def state_head_end(row: Row, text: str) -> int | None:
    """Where `{"evidence": <state>` ends in the rendered text (None: the template changed it)."""
    position = text.find(user_message(row))
    return None if position < 0 else position + len(state_head(row))


def state_prefix_ids(
    plan: Layout, row: Row, text: str, body_ids: list[int], cut: Cut | None = None
) -> list[int]:
    """Tokens of the rendered text through the evidence, minus the last (it may merge onward),
    encoded as `plan` encodes row 0's prompt `text`: its head's ids, then its body's up to the
    evidence's end. With row 0's `body_ids` and a `Cut` that holds that far, only the body's
    end is encoded."""
    end = state_head_end(row, text)
    if end is None:
        raise PromptRejected(
            "shared prefix guard: the chat template changed the user message, so the state "
            "prefix cannot be located"
        )
    pieces = plan.pieces[0]
    end -= len(pieces.head)
    if cut is not None and end >= cut.until:
        body = body_ids[: cut.tokens] + encode(plan.encoder, pieces.body[cut.chars : end])
    else:
        body = encode(plan.encoder, pieces.body[:end])
    prefix_ids = (plan.outer[pieces.head] + body)[:-1]
    if not prefix_ids:
        raise PromptRejected("shared prefix guard: the state prefix encodes to no tokens")
    return prefix_ids


def shared_prefix(prefix_ids: list[int], prompts: list[EncodedPrompt]) -> list[int]:
    """The longest start of `prefix_ids` that every prompt's token ids begin with."""
    length = len(prefix_ids)
    for prompt in prompts:
        length = min(length, common_ids_length(prefix_ids, prompt.ids))
    if length == 0:
        raise PromptRejected("shared prefix guard: the prompts share no leading tokens")
    return prefix_ids[:length]


def common_ids_length(left: list[int], right: list[int]) -> int:
    if right[: len(left)] == left:  # the usual case, at C speed
        return min(len(left), len(right))
    for index, (a, b) in enumerate(zip(left, right)):
        if a != b:
            return index
    return min(len(left), len(right))
