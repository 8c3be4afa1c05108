"""What every `accept` check returns, and the `/decide/shared` body the checks send."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Check:
    name: str
    status: str  # pass | fail | skipped
    measured: str
    threshold: str
    details: dict[str, Any] = field(default_factory=dict)


def status(passed: bool) -> str:
    return "pass" if passed else "fail"


def shared_body(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One /decide/shared body for rows over one state."""
    return {
        "state": rows[0]["state"],
        "decisions": [{key: row[key] for key in ("id", "question", "options")} for row in rows],
    }
