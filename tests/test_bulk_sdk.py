"""Issue 39: a bulk tool on its SDK's defaults against a plain server. The official typesafe-sdk,
unmodified (its 10 s timeout and its retry policy, which honours Retry-After / retry-after-ms),
sends one single-question System One request per item from 16 threads at once, 50 items over
distinct short states (grep lines), to `semif-serve serve` under gunicorn on the built-in
SmolLM2 with every setting at its default; no item may fail.

Bounded: every call ends within the SDK's own retry budget (30 s), and the whole run within
RUN_BOUND_S, or the test fails naming what was left."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor, wait

import pytest
from fakes import TOKEN
from live_server import LiveServer, real_env, semif_serve_command
from typesafe_sdk import Noul, TypeSafeClient, TypeSafeError

pytestmark = [pytest.mark.slow, pytest.mark.server]

THREADS = 16
ITEMS = 50
RUN_BOUND_S = 240  # far past what 50 items take; reached only if calls hang
WORDS = "printer network invoice refund outage login error timeout ticket report".split()
QUESTION = "Does this line report a failure?"


def lines(count: int) -> list[str]:
    rng = random.Random(39)
    return [
        f"{index:04d} " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12)))
        for index in range(count)
    ]


@pytest.fixture(scope="module")
def server(tmp_path_factory, builtin_cache):
    folder = tmp_path_factory.mktemp("bulk")
    with LiveServer(semif_serve_command(), real_env(builtin_cache), folder / "server.log") as live:
        yield live


def test_fifty_items_from_sixteen_threads_on_the_sdk_defaults_all_succeed(server):
    items = lines(ITEMS)
    client = TypeSafeClient(api_key=TOKEN, base_url=f"http://127.0.0.1:{server.port}")

    def ask(line: str) -> float:
        reply = client.system_one(
            state={"line": line}, questions={"q": Noul(instructions=QUESTION)}
        )
        return reply.nouls["q"].noul

    with client, ThreadPoolExecutor(THREADS) as pool:
        futures = {pool.submit(ask, line): line for line in items}
        done, pending = wait(futures, timeout=RUN_BOUND_S)
        assert not pending, f"{len(pending)} items still running after {RUN_BOUND_S} s"
        failed = {}
        for future in done:
            try:
                answer = future.result()
                assert 0.0 <= answer <= 1.0
            except TypeSafeError as error:
                failed[futures[future]] = repr(error)
    assert failed == {}, f"{len(failed)} of {ITEMS} items failed: {list(failed.values())[:3]}"
