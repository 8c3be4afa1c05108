"""How far two scorings of the same rows are apart: the largest probability difference between
paired results, after checking that each pair is the same row (id, options) over the same prompt."""

from __future__ import annotations


def worst_difference(expected: list[dict], results: list[dict]) -> float:
    worst = 0.0
    for one, other in zip(expected, results, strict=True):
        assert (one["id"], one["option_ids"]) == (other["id"], other["option_ids"])
        assert one["prompt_sha256"] == other["prompt_sha256"]
        pairs = zip(one["probabilities"], other["probabilities"], strict=True)
        worst = max(worst, *(abs(a - b) for a, b in pairs))
    return worst
