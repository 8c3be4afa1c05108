"""Rows for scoring tests: one shared state, questions and options of varied lengths."""

from __future__ import annotations

STATE = {
    "ticket": "The printer on floor 3 is jammed again and shows error E-42 after every job.",
    "reporter": "Ana Müller",
    "history": ["jammed on Monday", "toner replaced Tuesday"],
}


def make_rows(count: int, options: int | list[int], state=STATE, prefix: str = "q") -> list[dict]:
    """`count` rows over `state`; row i has `options[i % len(options)]` options and a question
    of its own length, so suffixes differ and the shared batch needs padding."""
    sizes = options if isinstance(options, list) else [options]
    rows = []
    for index in range(count):
        size = sizes[index % len(sizes)]
        question = (
            f"Criterion {index}: does the ticket concern "
            + "hardware and " * (index % 5)
            + "the printer?"
        )
        rows.append(
            {
                "id": f"{prefix}{index}",
                "state": state,
                "question": question,
                "options": [
                    {
                        "id": f"opt{k}",
                        "description": f"option {k}" + " (detail)" * ((index + k) % 3),
                    }
                    for k in range(size)
                ],
            }
        )
    return rows
