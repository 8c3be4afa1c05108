"""Deterministic shape-like workloads: S states × C binary criteria, states of about T tokens;
and an agent's log that grows by one event per version (issue 31's growing states).

Seeded text from a fixed word list, so every run scores the same prompts; nothing is downloaded.
"""

from __future__ import annotations

import random

from semif_serve.state_key import state_json

WORDS = (
    "invoice customer payment refund account service outage printer network billing contract "
    "delivery warehouse supplier shipment delay report audit finance support ticket priority "
    "escalation manager review policy renewal discount error timeout login password security "
    "access request approval budget forecast quarter region office team schedule meeting"
).split()
CRITERIA = [
    "Does the record report being charged more than once?",
    "Does the record mention a refund request?",
    "Is a specific deadline mentioned?",
    "Does the customer threaten to cancel?",
    "Is the problem related to a plan change?",
    "Does the record report a technical error?",
    "Is an error code quoted?",
    "Is the customer on a business plan?",
    "Does the record contain an attachment?",
    "Is this the first contact with support?",
    "Does the record concern the mobile app?",
    "Is the tone hostile or abusive?",
    "Does the record mention an audit?",
    "Are monetary amounts given?",
    "Is the record about a security breach?",
    "Does the customer ask for a phone call?",
    "Is more than one problem reported?",
    "Does the record concern invoices?",
    "Should billing handle it?",
    "Should engineering handle it?",
    "Can it be resolved without human review?",
]
YES_NO = [{"id": "yes", "description": "Yes"}, {"id": "no", "description": "No"}]


def make_state(rng: random.Random, words: int, note_words: tuple[int, int] = (8, 20)) -> dict:
    notes = []
    while sum(len(note.split()) for note in notes) < words:
        notes.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(*note_words))) + ".")
    return {"record": f"R-{rng.randint(10000, 99999)}", "notes": notes}


def make_workload(
    tokenizer, states: int = 3, criteria: int = 21, tokens: int = 2000, seed: int = 7
) -> list[list[dict]]:
    """`states` groups of `criteria` rows; each state grown until its prompt has ~`tokens`."""
    from semif_serve.scoring import parse_row
    from semif_serve.scoring.prompt import encode_prompt

    rng = random.Random(seed)
    groups = []
    for index in range(states):
        words = max(4, tokens // 2)
        while True:
            state = make_state(random.Random(seed * 1000 + index), words)
            rows = [
                {
                    "id": f"s{index}c{c}",
                    "state": state,
                    "question": CRITERIA[c % len(CRITERIA)],
                    "options": YES_NO,
                }
                for c in range(criteria)
            ]
            length = len(encode_prompt(tokenizer, parse_row(rows[0]), 1 << 20).ids)
            if length >= tokens or words > tokens * 4:
                break
            words = int(words * max(1.05, tokens / max(length, 1)))
        rng.shuffle(rows)
        groups.append(rows)
    return groups


def distinct_states(tokenizer, count: int, tokens: int, seed: int) -> list[dict]:
    """`count` rows, each over its own state of about `tokens` prompt tokens (callers that share
    nothing: the batcher's workload)."""
    return [group[0] for group in make_workload(tokenizer, count, 1, tokens, seed)]


def short_states(count: int, seed: int) -> list[dict]:
    """`count` rows, each over its own state of one note of 2-6 words: the shortest decisions a
    caller sends (SmolLM2 prompts of about 100-115 tokens; the bare prompt is ~95)."""
    rng = random.Random(seed)
    return [
        {
            "id": f"short{index}",
            "state": make_state(rng, 2, note_words=(2, 6)),
            "question": CRITERIA[index % len(CRITERIA)],
            "options": YES_NO,
        }
        for index in range(count)
    ]


EVENT = "step {n}: the agent read the ticket queue, picked ticket {n} and logged what it found."


def log_state(kind: str, events: int, base: int, topic: str = "printer") -> object:
    """An agent's log after `events` events over `base` earlier ones: text lines, or JSON."""
    lines = [EVENT.format(n=n) + f" ({topic})" for n in range(base + events)]
    if kind == "text":
        return "\n".join(lines)
    return {
        "agent": f"triage-{topic}",
        "events": [{"n": n, "note": line} for n, line in enumerate(lines)],
    }


def events_for(tokenizer, kind: str, tokens: int) -> int:
    """Events of a `kind` log whose state is about `tokens` tokens long as the prompt embeds it."""
    per_ten = len(tokenizer.encode(state_json(log_state(kind, 0, 10))))
    return max(2, round(10 * tokens / per_ten))


def row(state: object, question: str = "Has the agent found the printer fault?") -> dict:
    return {
        "id": "q",
        "state": state,
        "question": question,
        "options": [
            {"id": "yes", "description": "Yes"},
            {"id": "no", "description": "No"},
            {"id": "unclear", "description": "Cannot tell yet"},
        ],
    }
