"""Two real replicas (the built-in SmolLM2 on the CPU) behind real nginx running
deploy/nginx/semif.conf, called through `semif_serve.client`.

Asserted: every request about one state reaches one replica (>= 99%); over one interleaved
workload, routing by X-Semif-State-Key gets more state-prefix cache hits than round-robin (each
state misses once, on its one replica); killing one replica mid-run moves its states to the
other and loses no request: every call gets its own result, even those the killed replica held
(nginx re-sends them); the versions of one session's growing state all reach one replica and
resume each other's prefills. Run with `-s` to print the figures quoted in docs/deploy.md.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import pytest
from fakes import TOKEN
from live_server import LiveServer, real_env, semif_serve_command
from nginx_proxy import Nginx, nginx_binary

from semif_serve.client import Client, RetryPolicy, SemifError, state_key

pytestmark = [pytest.mark.slow, pytest.mark.server]

STATES = 7  # odd, so a fixed alternation cannot line up with the states
QUESTIONS = 5
QUESTION_TEXTS = (
    "Does the ticket concern hardware?",
    "Is the reporter named?",
    "Was the toner replaced?",
    "Is this the first report?",
    "Should a technician visit?",
)
CALL_DEADLINE_S = 120
KILL_STREAM = 36  # requests in the kill run
KILL_AFTER = 8  # completed requests before the kill
KILL_THREADS = 3
WAIT_S = 120  # the bound on every wait for the other threads


def long_state(name: str) -> dict:
    """A state of some 400 tokens, over the prefix cache's 128-token minimum."""
    return {
        "ticket": f"Case {name}: the printer on floor 3 shows error E-42 after every job.",
        "history": [f"{name}: jammed on day {day}, toner checked" for day in range(24)],
    }


def request(state_name: str, question: int) -> dict:
    return {
        "id": f"{state_name}/q{question}",
        "state": long_state(state_name),
        "question": QUESTION_TEXTS[question],
        "options": [
            {"id": "yes", "description": "Yes"},
            {"id": "no", "description": "No"},
            {"id": "unclear", "description": "Cannot tell"},
        ],
    }


def workload(prefix: str, seed: int) -> list[dict]:
    """STATES x QUESTIONS requests, interleaved in a seeded random order."""
    asked = [request(f"{prefix}{s}", q) for s in range(STATES) for q in range(QUESTIONS)]
    random.Random(seed).shuffle(asked)
    return asked


@pytest.fixture(scope="module")
def nginx():
    """nginx's path: installed when missing, or the tests skip saying why (before any replica
    starts)."""
    return nginx_binary()


@pytest.fixture
def replicas(nginx, tmp_path, builtin_cache, smollm2):
    """Two real replicas (the `smollm2` fixture has already converted the weights they load)."""
    with ExitStack() as stack:
        servers = [
            stack.enter_context(
                LiveServer(
                    semif_serve_command(), real_env(builtin_cache), tmp_path / f"replica{n}.log"
                )
            )
            for n in range(2)
        ]
        yield servers


def client(router: Nginx) -> Client:
    return Client(router.url, TOKEN, policy=RetryPolicy(deadline_s=CALL_DEADLINE_S))


def run_in_order(router: Nginx, asked: list[dict]) -> list[dict]:
    """One call at a time, so each replica's cache sees the order `asked` gives."""
    with client(router) as caller:
        results = [caller.decide(body) for body in asked]
    assert [result["id"] for result in results] == [body["id"] for body in asked]
    return results


def replica_of_each_state(router: Nginx, requests: int) -> dict[str, Counter]:
    """For each state key, how many of the router's first `requests` each replica answered."""
    served: dict[str, Counter] = defaultdict(Counter)
    for line in router.access(requests):
        served[line.state_key][line.upstreams[-1]] += 1
    return served


def hits(results: list[dict]) -> int:
    return sum(result["cache_hit"] for result in results)


def test_one_state_reaches_one_replica_and_beats_round_robin_on_cache_hits(tmp_path, replicas):
    ports = [server.port for server in replicas]
    with Nginx(tmp_path / "hashed", ports) as hashed:
        routed = run_in_order(hashed, workload("routed", seed=1))
        served = replica_of_each_state(hashed, STATES * QUESTIONS)
    with Nginx(tmp_path / "round-robin", ports, hashed=False) as round_robin:
        spread = run_in_order(round_robin, workload("spread", seed=1))
        spread_served = replica_of_each_state(round_robin, STATES * QUESTIONS)

    # nginx hashed on the key the client sent: the sha256 of each state's JSON.
    assert set(served) == {state_key(long_state(f"routed{s}")) for s in range(STATES)}
    on_its_replica = sum(max(counts.values()) for counts in served.values())
    assert on_its_replica / (STATES * QUESTIONS) >= 0.99
    # Routed by state, each state misses once (its first question) and then hits.
    assert hits(routed) == STATES * (QUESTIONS - 1)
    # Round-robin gives a state's questions to both replicas, and each prefills it.
    both = sum(len(counts) == 2 for counts in spread_served.values())
    assert both >= 1 and hits(spread) == STATES * QUESTIONS - sum(
        len(counts) for counts in spread_served.values()
    )
    assert hits(spread) < hits(routed)
    print(
        f"\nreplicas: affinity {on_its_replica}/{STATES * QUESTIONS} on one replica, "
        f"{len({next(iter(c)) for c in served.values()})} replicas used; prefix-cache hit rate "
        f"routed {hits(routed) / len(routed):.2f} vs round-robin {hits(spread) / len(spread):.2f} "
        f"({both}/{STATES} states on both replicas)"
    )


GROWN_VERSIONS = 20


def grown_log(version: int) -> dict:
    """An agent's log after `version` more events: each version appends one to the last."""
    state = long_state("agent")
    events = [
        f"event {n}: the agent checked the tray and logged the result" for n in range(version)
    ]
    return {**state, "history": state["history"] + events}


def test_a_sessions_growing_state_stays_on_one_replica_and_reuses_its_last_version(
    tmp_path, replicas
):
    """20 versions of one growing state, one question each, under one X-Semif-Session: each
    version's state key differs, the session routes all of them to one replica, and every
    version after the first resumes the stored prefill of the one before (issue 31)."""
    with Nginx(tmp_path / "hashed", [server.port for server in replicas]) as router:
        with client(router) as caller:
            results = [
                caller.decide({**request("agent", 0), "state": grown_log(v)}, session="agent-1")
                for v in range(GROWN_VERSIONS)
            ]
        log = router.access(GROWN_VERSIONS)
    assert {line.session for line in log} == {"agent-1"}
    assert len({line.upstreams[-1] for line in log}) == 1  # one replica served every version
    assert results[0]["cached_tokens"] == 0 and not results[0]["cache_hit"]
    grown = results[1:]
    assert all(result["cached_tokens"] > 0 and not result["cache_hit"] for result in grown)
    assert {result["reuse_point"] for result in grown} <= {"end", "crop"}
    reused = sum(result["cached_tokens"] for result in grown)
    print(
        f"\nreplicas: {GROWN_VERSIONS} versions of one session's growing state on one replica; "
        f"{reused / sum(r['input_tokens'] for r in grown):.2f} of the grown versions' tokens "
        "resumed from the version before"
    )


def replica_processes(server: LiveServer) -> list[int]:
    """The replica's gunicorn master and its worker."""
    pid = server.process.pid
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [pid, *map(int, children)]


def signal_replica(pids: list[int], signum: int) -> None:
    for pid in pids:
        os.kill(pid, signum)


def test_killing_a_replica_mid_run_moves_its_states_and_loses_no_request(tmp_path, replicas):
    """The victim is frozen (SIGSTOP) first, so the calls it holds at the SIGKILL are known:
    those started for its states and not finished. nginx re-sends them, so none of them fails."""
    with Nginx(tmp_path / "hashed", [server.port for server in replicas]) as router:
        # Learn where each state lives, and warm both caches.
        names = [f"kill{s}" for s in range(STATES)]
        run_in_order(router, [request(name, 0) for name in names])
        home = {
            key: counts.most_common(1)[0][0]
            for key, counts in replica_of_each_state(router, STATES).items()
        }
        victim_address = Counter(home.values()).most_common(1)[0][0]
        victim = next(s for s in replicas if victim_address == f"127.0.0.1:{s.port}")
        survivor = next(s for s in replicas if s is not victim)
        victim_states = {
            name for name in names if home[state_key(long_state(name))] == victim_address
        }

        draw = random.Random(2)
        picks = [draw.choice(names) for _ in range(KILL_STREAM)]
        asked = [
            {**request(name, 1 + n % (QUESTIONS - 1)), "id": f"call{n}"}
            for n, name in enumerate(picks)
        ]
        on_victim = {f"call{n}" for n, name in enumerate(picks) if name in victim_states}
        started: set[str] = set()
        done: dict[str, dict] = {}
        failed: dict[str, SemifError] = {}
        changed = threading.Condition()

        def call(caller: Client, body: dict) -> None:
            with changed:
                started.add(body["id"])
                changed.notify_all()
            try:
                outcome: dict | SemifError = caller.decide(body)
            except SemifError as error:
                outcome = error
            with changed:
                (failed if isinstance(outcome, SemifError) else done)[body["id"]] = outcome
                changed.notify_all()

        def held() -> set[str]:
            return (started & on_victim) - set(done) - set(failed)

        def all_answered() -> bool:
            return len(done) + len(failed) == KILL_STREAM

        pids = replica_processes(victim)
        with client(router) as caller, ThreadPoolExecutor(KILL_THREADS) as pool:
            for body in asked:
                pool.submit(call, caller, body)
            with changed:
                assert changed.wait_for(lambda: len(done) >= KILL_AFTER, WAIT_S), "stalled"
            signal_replica(pids, signal.SIGSTOP)
            with changed:
                assert changed.wait_for(held, WAIT_S), "no call reached the frozen replica"
                in_flight = held()
            signal_replica(pids, signal.SIGKILL)
            victim.process.wait(WAIT_S)
            killed_at = time.time()
            with changed:
                assert changed.wait_for(all_answered, WAIT_S), "stalled after the kill"
        log = router.access(STATES + KILL_STREAM)

    # Nothing lost: every request has its own result or an error.
    assert set(done) | set(failed) == {body["id"] for body in asked}
    assert all(result["id"] == body_id for body_id, result in done.items())
    # No error at all, not even for the calls the killed replica held: nginx re-sent them
    # (semif.conf: `proxy_next_upstream error non_idempotent`).
    assert not failed, failed
    # After the kill every call ended on the survivor: the held ones re-sent by nginx, the
    # victim's states moved.
    after = [line for line in log if line.at >= killed_at]
    survivor_address = f"127.0.0.1:{survivor.port}"
    assert all(line.upstreams[-1] == survivor_address for line in after), after
    victim_keys = {state_key(long_state(name)) for name in victim_states}
    assert any(line.state_key in victim_keys for line in after)
    resent = sum(line.upstreams[0] == victim_address for line in after)
    print(
        f"\nreplicas: killed 1 of 2 replicas holding {len(in_flight)} calls; "
        f"{len(done)}/{KILL_STREAM} results, {len(failed)} errors; {resent} calls re-sent "
        f"to the survivor by nginx, {len(after) - resent} later calls straight to it"
    )
