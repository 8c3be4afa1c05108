"""`accept`'s speed check: shared scoring against direct scoring of the same rows, with the
state-prefix cache kept out of the comparison.

Each repeat times one `/decide/shared` call over the rows (the state prefilled once, then one
suffix per row) against the same rows as separate `/decide` calls (each a whole prompt). Every
timed call names a session never used before (`X-Semif-Session`): the server reuses and stores
state prefixes only within a session (docs/api.md), so no timed call can resume a prefix that
another stored, and both sides score cold. (Without that, every direct call after the first
found the state in the cache, and the check measured the cache, not shared scoring.) A reply
that still says it resumed a stored prefix (`cache_hit`, `cached_tokens` > 0) fails the check.
"""

from __future__ import annotations

import statistics
import uuid
from collections.abc import Callable, Iterable
from typing import Any

from semif_serve.client import Client
from semif_serve.quality.checks import Check, shared_body, status

SPEED_CRITERIA = 21
SESSION_PREFIX = "semif-accept-speed-"


def fresh_session() -> str:
    """A session name no other call has used: its calls find nothing in the prefix cache."""
    return SESSION_PREFIX + uuid.uuid4().hex


def resumed(fields: dict[str, Any]) -> bool:
    """Whether a /decide result or a /decide/shared timing says a stored prefix was resumed."""
    return bool(fields.get("cache_hit")) or (fields.get("cached_tokens") or 0) > 0


def speed_check(
    client: Client,
    rows: list[dict[str, Any]],
    *,
    repeats: int,
    max_decisions: int,
    max_p50_s: float | None,
    clock: Callable[[], float],
    bar: Callable[[list, str], Iterable],
) -> Check:
    """`repeats` timings of one cold shared call vs len(rows) cold /decide calls, after one
    untimed shared warm-up; `bar` wraps an iteration in a progress bar."""
    threshold = (
        "all replies complete and cold (a new session per call); "
        f"shared p50 <= p50 of {len(rows)} separate /decide calls"
    )
    if max_p50_s is not None:
        threshold += f"; shared p50 <= {max_p50_s} s"
    if max_decisions < len(rows):
        return Check("speed", "fail", f"max_decisions is {max_decisions}", threshold)
    body = shared_body(rows)
    expected = [row["id"] for row in rows]
    client.decide_shared(body, session=fresh_session())  # warm-up, not timed
    shared, direct, server = [], [], []
    warm = 0  # timed replies that resumed a stored prefix anyway
    for _ in bar(list(range(repeats)), "speed"):
        session = fresh_session()
        started = clock()
        reply = client.decide_shared(body, session=session)
        shared.append(clock() - started)
        if [result["id"] for result in reply["results"]] != expected:
            return Check("speed", "fail", "a shared reply lacks rows or reorders them", threshold)
        server.append(reply["timing"].get("total_seconds"))
        warm += resumed(reply["timing"])
        sessions = [fresh_session() for _ in rows]
        started = clock()
        results = [client.decide(row, session=name) for row, name in zip(rows, sessions)]
        direct.append(clock() - started)
        warm += sum(resumed(result) for result in results)
    shared_p50, direct_p50 = statistics.median(shared), statistics.median(direct)
    passed = (
        warm == 0 and shared_p50 <= direct_p50 and (max_p50_s is None or shared_p50 <= max_p50_s)
    )
    details = {
        "compared": f"1 /decide/shared call vs {len(rows)} /decide calls, each in its own session",
        "criteria": len(rows),
        "repeats": repeats,
        "shared_seconds": shared,
        "direct_seconds": direct,
        "shared_p50_s": shared_p50,
        "shared_spread_s": [min(shared), max(shared)],
        "direct_p50_s": direct_p50,
        "speedup": direct_p50 / shared_p50 if shared_p50 > 0 else None,
        "server_total_seconds": server,
        "replies_from_cache": warm,
    }
    measured = (
        f"cold: 1 shared call p50 {shared_p50:.3f} s ({min(shared):.3f}..{max(shared):.3f}), "
        f"{len(rows)} /decide calls p50 {direct_p50:.3f} s"
    )
    if details["speedup"] is not None:
        measured += f", {details['speedup']:.1f}x"
    if warm:
        measured += f"; {warm} of {repeats * (len(rows) + 1)} replies resumed a cached prefix"
    return Check("speed", status(passed), measured, threshold, details)
