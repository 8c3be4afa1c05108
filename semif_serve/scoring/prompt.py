"""The direct-options-v1 prompt: two chat messages, rendered and encoded, with every guard.

A row becomes `EncodedPrompt` (text, token ids, the option letters' token ids, sha256) or a
`PromptRejected` (a ValueError) naming the guard that failed. Nothing is ever truncated.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Protocol

from semif_serve.scoring.rows import Row, RowError, state_json

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
    `PromptRejected` with `row_index` i for the first prompt that fails.
    """
    probes = [
        (index, letter, letter_id)
        for index, row_letters in enumerate(letter_ids)
        for letter, letter_id in zip(LETTERS, row_letters)
    ]
    encoded = encode_many(tokenizer, [texts[index] + letter for index, letter, _ in probes])
    for (index, letter, letter_id), with_letter in zip(probes, encoded):
        if with_letter != ids[index] + [letter_id]:
            raise PromptRejected(
                f"answer boundary guard: prompt + {letter!r} does not encode as the prompt's "
                "tokens followed by the letter's token",
                row_index=index,
            )


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
    texts = []
    for index, row in enumerate(rows):
        texts.append(_with_index(index, render, tokenizer, row))
    ids = encode_many(tokenizer, texts)
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
