"""A caller's breakpoints as positions in the state prefix's token ids.

An OpenAI Decisions caller may mark an input part with `prompt_cache_breakpoint`: the end of a
prefix it will send again, as an agent's log before the events it appends next. The API layer
records where each marked text ends in the state as the prompt shows it (`Row.breakpoints`:
character offsets into `Row.state_key`). A hybrid model's stored prefix resumes only at a
checkpoint (`scoring.checkpoints`), so each mark becomes one: at the last token boundary at or
before the mark that the prompt's own tokens share. Attention-only entries resume anywhere and
need no mark; the marks cost them nothing.
"""

from __future__ import annotations

from semif_serve.scoring.prompt import ChatTokenizer, encode
from semif_serve.scoring.rows import Row
from semif_serve.scoring.shared_prompts import common_ids_length, state_head_end

# The marks a call keeps, the last ones (nearest where a growing state goes on): each costs one
# encoding of the prompt up to it now, and a checkpoint's bytes in the prefix cache later.
MAX_BREAKPOINTS = 4


def breakpoint_positions(
    tokenizer: ChatTokenizer, row: Row, text: str, prefix_ids: list[int]
) -> tuple[int, ...]:
    """The positions in `prefix_ids` (row's state prefix in its rendered prompt `text`) where
    the row's last MAX_BREAKPOINTS breakpoints fall, each the longest start of the prefix that
    the text through the mark encodes to; positions at 0 or at the prefix's end mark nothing."""
    head_end = state_head_end(row, text) if row.breakpoints else None
    if head_end is None:
        return ()
    state_start = head_end - len(row.state_key)
    positions = set()
    for offset in row.breakpoints[-MAX_BREAKPOINTS:]:
        through = encode(tokenizer, text[: state_start + offset])
        position = common_ids_length(through, prefix_ids)
        if 0 < position < len(prefix_ids):
            positions.add(position)
    return tuple(sorted(positions))
