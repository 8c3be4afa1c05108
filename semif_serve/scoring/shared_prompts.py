"""The shared scorer's encoding stage: rows over one exact state → prompts and the state prefix.

Every row's full prompt is encoded with every direct guard, and the state prefix is the rendered
text up to and including `{"evidence": <state>`, minus its last token, since JSON punctuation
can merge with the token after it. Upstream SemIf raises when a prompt's tokens do not start
with that prefix; here the prefix backs off to the tokens every prompt does share (a state
ending in `}]}` merges further back than one token on common BPE vocabularies). Either way each
row is scored on exactly the token ids the direct scorer would see.
"""

from __future__ import annotations

from semif_serve.scoring.prompt import (
    ChatTokenizer,
    EncodedPrompt,
    PromptRejected,
    encode,
    encode_prompts,
    state_head,
    user_message,
)
from semif_serve.scoring.rows import InvalidRow, Row, as_row


def encode_shared(
    tokenizer: ChatTokenizer, rows: list[Row | dict], max_tokens: int
) -> tuple[list[Row], list[EncodedPrompt], list[int]]:
    """(parsed rows, their prompts, the state prefix every prompt's ids begin with)."""
    parsed = check_shared_rows(_parse_rows(rows))
    prompts = _encode_rows(tokenizer, parsed, max_tokens)
    prefix_ids = shared_prefix(state_prefix_ids(tokenizer, parsed[0], prompts[0].text), prompts)
    return parsed, prompts, prefix_ids


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


def _encode_rows(tokenizer: ChatTokenizer, rows: list[Row], max_tokens: int) -> list[EncodedPrompt]:
    try:
        return encode_prompts(tokenizer, rows, max_tokens)
    except PromptRejected as error:
        index = error.row_index
        raise PromptRejected(f"rows[{index}]: {error}", row_index=index) from None


def state_prefix_ids(tokenizer: ChatTokenizer, row: Row, text: str) -> list[int]:
    """Tokens of the rendered text through the evidence, minus the last (it may merge onward)."""
    content = user_message(row)
    position = text.find(content)
    if position < 0:
        raise PromptRejected(
            "shared prefix guard: the chat template changed the user message, so the state "
            "prefix cannot be located"
        )
    prefix_ids = encode(tokenizer, text[: position + len(state_head(row))])[:-1]
    if not prefix_ids:
        raise PromptRejected("shared prefix guard: the state prefix encodes to no tokens")
    return prefix_ids


def shared_prefix(prefix_ids: list[int], prompts: list[EncodedPrompt]) -> list[int]:
    """The longest start of `prefix_ids` that every prompt's token ids begin with."""
    length = len(prefix_ids)
    for prompt in prompts:
        length = min(length, _common_length(prefix_ids, prompt.ids))
    if length == 0:
        raise PromptRejected("shared prefix guard: the prompts share no leading tokens")
    return prefix_ids[:length]


def _common_length(left: list[int], right: list[int]) -> int:
    for index, (a, b) in enumerate(zip(left, right)):
        if a != b:
            return index
    return min(len(left), len(right))
