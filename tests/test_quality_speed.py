"""`accept`'s speed check compares shared scoring with direct scoring, never with the state-prefix
cache: every timed call runs in a session of its own, and a reply that resumed a stored prefix
fails the check."""

from pathlib import Path

from fakes import TOKEN
from quality_fakes import CONTENT, FakeClock, ServedApp, TimedScorer, labelled_rows

from semif_serve.client import Client, RetryPolicy
from semif_serve.quality.accept import Acceptance, AcceptInputs
from semif_serve.quality.labelled import ROW_KEYS, read_plain_rows
from semif_serve.quality.speed import SESSION_PREFIX

TICKET_21 = Path(__file__).parents[1] / "docs" / "examples" / "ticket-21.jsonl"
ROWS = [{key: row[key] for key in ROW_KEYS} for row in labelled_rows()]


def speed_of(scorer, clock):
    with ServedApp(scorer) as server:
        inputs = AcceptInputs(rows=ROWS, speed_rows=read_plain_rows(TICKET_21))
        with Client(server.url, TOKEN, policy=RetryPolicy(deadline_s=10)) as client:
            report = Acceptance(client, inputs, clock=clock).run()
    return next(check for check in report["checks"] if check["name"] == "speed")


def test_every_timed_call_runs_cold_in_a_session_of_its_own():
    clock = FakeClock()
    scorer = TimedScorer(clock, 1.0, 2.0, base=CONTENT)
    speed = speed_of(scorer, clock)
    assert speed["status"] == "pass"
    assert speed["measured"] == (
        "cold: 1 shared call p50 2.000 s (2.000..2.000), 21 /decide calls p50 21.000 s, 10.5x"
    )
    assert speed["details"]["replies_from_cache"] == 0
    sessions = {"score": [], "score_shared": []}
    for kind, rows in scorer.calls:
        keys = {row.cache_key for row in (rows if kind == "score_shared" else [rows])}
        assert len(keys) == 1  # one call, one session
        sessions[kind] += [key for key in keys if key is not None]
    assert all(key.startswith(SESSION_PREFIX) for keys in sessions.values() for key in keys)
    assert len(sessions["score_shared"]) == 1 + 3  # the warm-up, then one per repeat
    assert len(sessions["score"]) == 21 * 3  # only the speed check names sessions
    every = sessions["score"] + sessions["score_shared"]
    assert len(set(every)) == len(every)  # never one twice: nothing stored is ever found


class CachedScorer(TimedScorer):
    """Answers direct calls as resumed from the prefix cache (a server that ignores sessions)."""

    def result(self, row):
        return {**super().result(row), "cache_hit": True, "cached_tokens": 300}


def test_replies_resumed_from_the_cache_fail_the_speed_check():
    clock = FakeClock()
    speed = speed_of(CachedScorer(clock, 1.0, 2.0, base=CONTENT), clock)
    assert speed["status"] == "fail"
    assert speed["details"]["replies_from_cache"] == 21 * 3
    assert speed["measured"].endswith("; 63 of 66 replies resumed a cached prefix")
