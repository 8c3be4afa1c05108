"""When do two runs over the same rows agree? The relation every accept comparison uses.

Row by row, with a tolerance t: the largest difference between the two runs' probabilities of the
same option is at most t, and both chose the same option, unless the first run's probabilities of
the two chosen options lie within t of each other (a near tie that a difference of t may flip).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from semif_serve.decisions import top_option

SHOWN_IDS = 10


@dataclass(frozen=True)
class RunComparison:
    rows: int
    agreeing: int
    same_top: int
    near_tie_flips: int
    max_gap: float
    disagreeing_ids: list[str] = field(default_factory=list)  # the first few, for the report

    @property
    def agreement(self) -> float:
        return self.agreeing / self.rows

    @property
    def top_agreement(self) -> float:
        return self.same_top / self.rows

    def as_dict(self) -> dict[str, Any]:
        return {
            "rows": self.rows,
            "agreeing": self.agreeing,
            "agreement": self.agreement,
            "same_top": self.same_top,
            "top_agreement": self.top_agreement,
            "near_tie_flips": self.near_tie_flips,
            "max_gap": self.max_gap,
            "disagreeing_ids": self.disagreeing_ids,
        }


def probability_by_option(result: dict[str, Any]) -> dict[str, float]:
    return dict(zip(result["option_ids"], result["probabilities"]))


def compare_runs(
    first: dict[str, dict[str, Any]], second: dict[str, dict[str, Any]], tolerance: float
) -> RunComparison:
    """Compare native results keyed by row id; `second` must hold every id of `first`."""
    if not first:
        raise ValueError("no rows to compare")
    agreeing = same_top = near_ties = 0
    max_gap = 0.0
    disagreeing: list[str] = []
    for row_id, result in first.items():
        other = second[row_id]
        mine, theirs = probability_by_option(result), probability_by_option(other)
        if set(mine) != set(theirs):
            raise ValueError(f"{row_id}: the runs scored different option ids")
        gap = max(abs(mine[option] - theirs[option]) for option in mine)
        max_gap = max(max_gap, gap)
        top = top_option(result["option_ids"], result["probabilities"])
        other_top = top_option(other["option_ids"], other["probabilities"])
        near_tie = top != other_top and mine[top] - mine[other_top] <= tolerance
        same_top += top == other_top
        near_ties += near_tie
        if gap <= tolerance and (top == other_top or near_tie):
            agreeing += 1
        elif len(disagreeing) < SHOWN_IDS:
            disagreeing.append(row_id)
    return RunComparison(len(first), agreeing, same_top, near_ties, max_gap, disagreeing)
