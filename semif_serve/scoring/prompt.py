"""The direct-options-v1 prompt: two chat messages, rendered and encoded, with every guard.

A row becomes `EncodedPrompt` (text, token ids, the option letters' token ids, sha256) or a
`PromptRejected` (a ValueError) naming the guard that failed. Nothing is ever truncated.
The answer-boundary guard re-encodes only the text after a prompt's last added token when the
tokenizer is known to encode that piece on its own (`added_tokens`); its verdicts are exactly
those of re-encoding the whole prompt + letter (tests/test_prompt_fastpath.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Protocol

from semif_serve.scoring.rows import Row, RowError
from semif_serve.state_key import state_json

PROMPT_VERSION = "direct-options-v1"
LETTERS = "ABCDEFGHIJKLMNOP"
SYSTEM_PROMPT = (
    "Apply the supplied criterion to the supplied evidence. Choose exactly one listed option. "
    "Respond with only its uppercase letter, with no explanation or reasoning."
)


class PromptRejected(RowError):
    """The prompt for a row cannot be scored faithfully; the message names the guard."""


class ChatTokenizer(Protocol):
    """What the scorers need from a tokenizer (transformers' tokenizers provide it)."""

    def apply_chat_template(self, conversation: list[dict], **kwargs: Any) -> Any: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class EncodedPrompt:
    text: str
    ids: list[int]
    letter_token_ids: list[int]

    @property
    def sha256(self) -> str:
        return prompt_sha256(self.text)


def user_message(row: Row) -> str:
    """The user turn: evidence, criterion and lettered options as one JSON object."""
    payload = {
        "evidence": row.state,
        "criterion": row.question,
        "options": [
            {"letter": LETTERS[index], "description": option.description}
            for index, option in enumerate(row.options)
        ],
    }
    return json.dumps(payload, ensure_ascii=False)


def state_head(row: Row) -> str:
    """How the user message begins: the evidence, without the closing brace (the shared prefix)."""
    return '{"evidence": ' + state_json(row.state)


def messages(row: Row) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_message(row)},
    ]


def render(tokenizer: ChatTokenizer, row: Row) -> str:
    """The chat template's text for the row, ready for the assistant's first token."""
    text = tokenizer.apply_chat_template(
        messages(row), tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    if not isinstance(text, str):
        raise PromptRejected("chat template: rendering did not return text")
    return text


def prompt_sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def encode(tokenizer: ChatTokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def encode_many(tokenizer: ChatTokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's token ids, as `encode` gives them; one batch call (transformers tokenizers
    encode a batch in parallel) when the tokenizer is callable, else one call per text."""
    if len(texts) > 1 and callable(tokenizer):
        batch = tokenizer(texts, add_special_tokens=False)["input_ids"]
        return [list(ids) for ids in batch]
    return [encode(tokenizer, text) for text in texts]


def letter_token_ids(tokenizer: ChatTokenizer, count: int) -> list[int]:
    """Token ids of the first `count` letters: one token each, all distinct, each decoding back."""
    letters = LETTERS[:count]
    ids = []
    for letter in letters:
        tokens = encode(tokenizer, letter)
        if len(tokens) != 1:
            raise PromptRejected(
                f"letter guard: {letter!r} encodes to {len(tokens)} tokens {tokens}, "
                "not exactly one"
            )
        ids.append(tokens[0])
    if len(set(ids)) != len(ids):
        raise PromptRejected(f"letter guard: letters share a token ({dict(zip(letters, ids))})")
    for letter, token in zip(letters, ids):
        decoded = tokenizer.decode([token])
        if decoded != letter:
            raise PromptRejected(
                f"letter guard: {letter!r} encodes to token {token}, which decodes to {decoded!r}"
            )
    return ids


def check_answer_boundary(
    tokenizer: ChatTokenizer, texts: list[str], ids: list[list[int]], letter_ids: list[list[int]]
) -> None:
    """The answer letter must be a token of its own after each prompt, never merged into it.

    texts[i] encodes to ids[i]; letter_ids[i] are its options' letter tokens. Raises
    `PromptRejected` with `row_index` i for the first prompt that fails, naming its first letter
    that fails. The verdicts are those of `answer_boundary_failures` (every whole prompt + letter
    re-encoded); where `added_tokens` vouches for the tokenizer, only the text after a prompt's
    last added token is re-encoded, since the letter cannot reach further back (`_tail_failure`).
    """
    added = added_tokens(tokenizer)
    memo: dict[str, tuple[list[int], dict[str, list[int]]]] = {}
    verdicts = [
        _UNDECIDED if added is None else _tail_failure(tokenizer, added, *row, memo)
        for row in zip(texts, ids, letter_ids)
    ]
    undecided = [index for index, verdict in enumerate(verdicts) if verdict is _UNDECIDED]
    full = answer_boundary_failures(
        tokenizer,
        [texts[index] for index in undecided],
        [ids[index] for index in undecided],
        [letter_ids[index] for index in undecided],
    )
    verdicts_by_index = dict(zip(undecided, full))
    for index, verdict in enumerate(verdicts):
        failing = verdicts_by_index[index] if verdict is _UNDECIDED else verdict
        if failing is not None:
            raise PromptRejected(
                f"answer boundary guard: prompt + {failing!r} does not encode as the prompt's "
                "tokens followed by the letter's token",
                row_index=index,
            )


def answer_boundary_failures(
    tokenizer: ChatTokenizer, texts: list[str], ids: list[list[int]], letter_ids: list[list[int]]
) -> list[str | None]:
    """Per prompt, its first letter whose token does not follow the prompt's own tokens when
    the whole prompt + letter is encoded (None: every letter does). The reference check."""
    probes = [
        (index, letter, letter_id)
        for index, row_letters in enumerate(letter_ids)
        for letter, letter_id in zip(LETTERS, row_letters)
    ]
    encoded = encode_many(tokenizer, [texts[index] + letter for index, letter, _ in probes])
    failures: list[str | None] = [None] * len(texts)
    for (index, letter, letter_id), with_letter in zip(probes, encoded):
        if failures[index] is None and with_letter != ids[index] + [letter_id]:
            failures[index] = letter
    return failures


@dataclass(frozen=True)
class AddedTokens:
    """The strings a fast tokenizer cuts out of any text as tokens of their own, first of all."""

    contents: tuple[str, ...]
    longest: int = field(init=False)
    letter_endings: tuple[str, ...] = field(init=False)  # contents a letter could complete

    def __post_init__(self) -> None:
        object.__setattr__(self, "longest", max(map(len, self.contents), default=0))
        endings = tuple(content for content in self.contents if content[-1] in LETTERS)
        object.__setattr__(self, "letter_endings", endings)


TAIL_WINDOW = 512  # characters searched first for a prompt's last added token (found near its end)


def added_tokens(tokenizer: ChatTokenizer) -> AddedTokens | None:
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


def _last_occurrence(text: str, added: AddedTokens, begin: int) -> tuple[int, str]:
    """(start, content) of the occurrence in text[begin:] that ends last; (-1, "") if none."""
    last, last_content = -1, ""
    for content in added.contents:
        start = text.rfind(content, begin)
        if start >= 0 and start + len(content) > last + len(last_content):
            last, last_content = start, content
    return last, last_content


_UNDECIDED = object()  # the tail shortcut cannot vouch for this prompt: re-encode it whole


def _tail_failure(
    tokenizer: ChatTokenizer,
    added: AddedTokens,
    text: str,
    prompt_ids: list[int],
    row_letters: list[int],
    memo: dict[str, tuple[list[int], dict[str, list[int]]]],
) -> str | None | object:
    """The first letter that merges into the prompt, judged on the prompt's tail alone: the text
    after its last added token is a piece the tokenizer encodes on its own, in the prompt and in
    prompt + letter alike, so prompt + letter encodes as the prompt's tokens + the letter's iff
    tail + letter encodes as the tail's tokens + the letter's. `_UNDECIDED` when the tail cannot
    be told apart, when a letter would complete an added token begun before the tail, or when
    the tail's tokens are not the prompt's last tokens."""
    start = tail_start(text, added)
    if start is None:
        return _UNDECIDED
    tail = text[start:]
    letters = LETTERS[: len(row_letters)]
    for content in added.letter_endings:
        if content[-1] in letters and len(content) > len(tail) + 1 and text.endswith(content[:-1]):
            return _UNDECIDED
    if tail not in memo:
        memo[tail] = (encode(tokenizer, tail), {})
    tail_ids, with_letters = memo[tail]
    if len(tail_ids) > len(prompt_ids) or prompt_ids[len(prompt_ids) - len(tail_ids) :] != tail_ids:
        return _UNDECIDED
    for letter, letter_id in zip(letters, row_letters):
        if letter not in with_letters:
            with_letters[letter] = encode(tokenizer, tail + letter)
        if with_letters[letter] != tail_ids + [letter_id]:
            return letter
    return None


def check_length(ids: list[int], max_tokens: int) -> None:
    if len(ids) > max_tokens:
        raise PromptRejected(
            f"max_tokens: the prompt has {len(ids)} tokens, over the limit of {max_tokens} "
            "(prompts are never truncated)"
        )


def encode_prompt(tokenizer: ChatTokenizer, row: Row, max_tokens: int) -> EncodedPrompt:
    """Render and encode the row's prompt, applying every guard."""
    try:
        return encode_prompts(tokenizer, [row], max_tokens)[0]
    except PromptRejected as error:
        raise PromptRejected(str(error)) from None


def encode_prompts(
    tokenizer: ChatTokenizer, rows: list[Row], max_tokens: int
) -> list[EncodedPrompt]:
    """Render and encode many rows' prompts with every guard, tokenizing each stage in one batch.

    A failure is a `PromptRejected` whose `row_index` is the row's position: the first guard (in
    the order render, length, letters, answer boundary) that any row fails, first row first.
    """
    texts = render_all(tokenizer, rows)
    return guard_prompts(tokenizer, rows, texts, encode_many(tokenizer, texts), max_tokens)


def render_all(tokenizer: ChatTokenizer, rows: list[Row]) -> list[str]:
    """Every row's rendered prompt; a render failure carries the row's position."""
    return [_with_index(index, render, tokenizer, row) for index, row in enumerate(rows)]


def guard_prompts(
    tokenizer: ChatTokenizer,
    rows: list[Row],
    texts: list[str],
    ids: list[list[int]],
    max_tokens: int,
) -> list[EncodedPrompt]:
    """The guards after rendering (length, letters, answer boundary), in that order over all
    rows, on texts[i] and its token ids ids[i] (exactly what `encode` gives for it)."""
    for index, row_ids in enumerate(ids):
        _with_index(index, check_length, row_ids, max_tokens)
    letters_by_count: dict[int, list[int]] = {}
    letter_ids = []
    for index, row in enumerate(rows):
        count = len(row.options)
        if count not in letters_by_count:
            letters_by_count[count] = _with_index(index, letter_token_ids, tokenizer, count)
        letter_ids.append(letters_by_count[count])
    check_answer_boundary(tokenizer, texts, ids, letter_ids)
    return [
        EncodedPrompt(text=text, ids=row_ids, letter_token_ids=row_letters)
        for text, row_ids, row_letters in zip(texts, ids, letter_ids)
    ]


def _with_index(index: int, check, *args):
    """Run one guard for row `index`; its rejection carries the row's position."""
    try:
        return check(*args)
    except PromptRejected as error:
        raise PromptRejected(str(error), row_index=index) from None
