"""The direct-options-v1 prompt: two chat messages, rendered and encoded, with every guard.

A row becomes `EncodedPrompt` (text, token ids, the option letters' token ids, sha256) or a
`PromptRejected` (a ValueError) naming the guard that failed. Nothing is ever truncated.
Caller text is always text (`layout`, `plain_text`): a prompt is cut around its user message
(`pieces`), and that piece is encoded without the control tokens, which only the template
writes; a prompt whose caller text holds none gets exactly the ids of encoding its whole text,
as upstream. The answer-boundary guard re-encodes only the text after a prompt's last added
token when the tokenizer is known to encode that piece on its own (`added_tokens`); its verdicts
are exactly those of re-encoding the whole prompt + letter (tests/test_prompt_fastpath.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol

from semif_serve.scoring.added_tokens import AddedTokens, added_tokens, tail_start
from semif_serve.scoring.length_bound import bytes_per_token, fewest_tokens
from semif_serve.scoring.pieces import Layout, Pieces, cut_prompt
from semif_serve.scoring.plain_text import control_tokens, plain_text
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


def messages(row: Row, user: str | None = None) -> list[dict[str, str]]:
    """The two chat messages; `user`: the row's `user_message`, when already computed."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": user_message(row) if user is None else user},
    ]


def render(tokenizer: ChatTokenizer, row: Row, user: str | None = None) -> str:
    """The chat template's text for the row, ready for the assistant's first token."""
    text = tokenizer.apply_chat_template(
        messages(row, user), tokenize=False, add_generation_prompt=True, enable_thinking=False
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
    endings = () if added is None else _letter_endings(added)
    memo: dict[str, tuple[list[int], dict[str, list[int]]]] = {}
    verdicts = [
        _UNDECIDED if added is None else _tail_failure(tokenizer, added, endings, *row, memo)
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


_UNDECIDED = object()  # the tail shortcut cannot vouch for this prompt: re-encode it whole


def _letter_endings(added: AddedTokens) -> tuple[str, ...]:
    """The added tokens' contents that an answer letter could complete."""
    return tuple(content for content in added.contents if content[-1] in LETTERS)


def _tail_failure(
    tokenizer: ChatTokenizer,
    added: AddedTokens,
    endings: tuple[str, ...],
    text: str,
    prompt_ids: list[int],
    row_letters: list[int],
    memo: dict[str, tuple[list[int], dict[str, list[int]]]],
) -> str | None | object:
    """The first letter that merges into the prompt, judged on the prompt's tail alone: the text
    after its last added token is a piece the tokenizer encodes on its own, in the prompt and in
    prompt + letter alike, so prompt + letter encodes as the prompt's tokens + the letter's iff
    tail + letter encodes as the tail's tokens + the letter's. `_UNDECIDED` when the tail cannot
    be told apart, when a letter would complete an added token begun before the tail (`endings`:
    `_letter_endings`), or when the tail's tokens are not the prompt's last tokens."""
    start = tail_start(text, added)
    if start is None:
        return _UNDECIDED
    tail = text[start:]
    letters = LETTERS[: len(row_letters)]
    for content in endings:
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


def check_fewest_tokens(tokenizer: ChatTokenizer, texts: list[str], max_tokens: int) -> None:
    """The cheap length guard, before any encoding: refuse a rendered prompt whose bytes alone
    prove it longer than `max_tokens` (`length_bound`; no bound, no refusal here)."""
    bound = bytes_per_token(tokenizer)
    if bound is None:
        return
    for index, text in enumerate(texts):
        fewest = fewest_tokens(text, bound)
        if fewest > max_tokens:
            raise PromptRejected(
                f"max_tokens: the prompt has at least {fewest} tokens, over the limit of "
                f"{max_tokens} (prompts are never truncated)",
                row_index=index,
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
    the order render, control tokens, length, letters, answer boundary) that any row fails,
    first row first.
    """
    users = [user_message(row) for row in rows]
    texts = render_all(tokenizer, rows, users)
    check_fewest_tokens(tokenizer, texts, max_tokens)
    plan = layout(tokenizer, rows, texts, users)
    body_ids = encode_many(plan.encoder, plan.bodies)
    return guard_prompts(
        tokenizer, rows, texts, plan.join(body_ids), max_tokens, plan.ends(body_ids)
    )


def render_all(tokenizer: ChatTokenizer, rows: list[Row], users: list[str]) -> list[str]:
    """Every row's rendered prompt (users[i]: row i's `user_message`); a render failure carries
    the row's position."""
    return [
        _with_index(index, render, tokenizer, row, user)
        for index, (row, user) in enumerate(zip(rows, users))
    ]


def layout(tokenizer: ChatTokenizer, rows: list[Row], texts: list[str], users: list[str]) -> Layout:
    """How to encode the rows' rendered prompts `texts` (users[i]: row i's `user_message`) so
    that no caller text becomes a control token: each prompt cut around its user message
    (`cut_prompt`), that piece encoded by the tokenizer's `PlainText`. Where the tokenizer has
    no control tokens, or a prompt cannot be cut (no fast backend `added_tokens` vouches for, a
    template that rewrote the message or writes no added token after it), every prompt is
    encoded whole; a row whose message then
    holds a control token is refused (`control tokens:`, carrying its `row_index`), never
    encoded with it.

    Why a prompt without control tokens in its caller text keeps its ids: a vouched-for tokenizer
    cuts a text at each added token and encodes the pieces between them on their own; the head
    ends and the tail begins at such cuts, the body holds no control token, and `PlainText` is
    the same pipeline with the same other added tokens (tests/test_control_tokens.py)."""
    control = control_tokens(tokenizer)
    added = added_tokens(tokenizer) if control else None
    if added is not None:
        head_ends: dict[str, int | None] = {}  # the rows' heads are usually one text
        pieces = [cut_prompt(text, user, added, head_ends) for text, user in zip(texts, users)]
        if None not in pieces:
            outer = sorted({p.head for p in pieces} | {p.tail for p in pieces})
            outer_ids = dict(zip(outer, _encode_template(tokenizer, outer)))
            return Layout(plain_text(tokenizer, control), pieces, outer_ids)
    for index, (row, user) in enumerate(zip(rows, users)):
        _with_index(index, check_no_control_text, row, user, control)
    return Layout(tokenizer, [Pieces("", text, "") for text in texts], {"": []})


def _encode_template(tokenizer: ChatTokenizer, texts: list[str]) -> list[list[int]]:
    """`encode_many` of the template's pieces, straight through the fast backend when it pads
    and truncates nothing: what transformers' call does then, less its overhead (the caller
    has checked through `added_tokens` that it encodes special tokens as such)."""
    backend = tokenizer.backend_tokenizer
    if backend.padding is not None or backend.truncation is not None:
        return encode_many(tokenizer, texts)
    return [backend.encode(text, add_special_tokens=False).ids for text in texts]  # short


def check_no_control_text(row: Row, message: str, control: frozenset[str]) -> None:
    """Refuse a row whose user message holds a control token (for prompts encoded whole)."""
    found = [content for content in control if content in message]
    if not found:
        return
    token = min(found, key=message.find)
    fields = [("state", state_json(row.state)), ("question", _json(row.question))]
    fields += [
        (f"options[{index}].description", _json(option.description))
        for index, option in enumerate(row.options)
    ]
    field = next((name for name, text in fields if token in text), "the user message")
    raise PromptRejected(
        f"control tokens: {field} holds {token!r}, which this tokenizer and chat template "
        "cannot encode as plain text"
    )


def _json(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def guard_prompts(
    tokenizer: ChatTokenizer,
    rows: list[Row],
    texts: list[str],
    ids: list[list[int]],
    max_tokens: int,
    ends: tuple[list[str], list[list[int]]] | None = None,
) -> list[EncodedPrompt]:
    """The guards after rendering (length, letters, answer boundary), in that order over all
    rows, on texts[i] and its token ids ids[i]. The answer-boundary guard runs on `ends`
    (`Layout.ends`: the text each letter follows and its ids), by default the whole texts and
    ids (then exactly what `encode` gives for each text)."""
    for index, row_ids in enumerate(ids):
        _with_index(index, check_length, row_ids, max_tokens)
    letters_by_count: dict[int, list[int]] = {}
    letter_ids = []
    for index, row in enumerate(rows):
        count = len(row.options)
        if count not in letters_by_count:
            letters_by_count[count] = _with_index(index, letter_token_ids, tokenizer, count)
        letter_ids.append(letters_by_count[count])
    end_texts, end_ids = (texts, ids) if ends is None else ends
    check_answer_boundary(tokenizer, end_texts, end_ids, letter_ids)
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
