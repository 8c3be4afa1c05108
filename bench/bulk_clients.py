"""bench/test_bulk_speed.py's parts (issue 39): the bulk tools' requests (one single-question
System One request per item, over a distinct ~120-token state), a caller that retries a 429/503
after the reply's retry-after-ms as those tools do (bounded), the server's /metrics gauges, and
the baseline: a git worktree of an earlier commit, served by this venv's python.

Both sides of a comparison are started the same way, `python -P -c LAUNCH serve` (what
`python -m semif_serve serve` runs) with PYTHONPATH naming their checkout; -P keeps the working
directory off sys.path, and the launcher logs which semif_serve it imported, so a bench can
check that each server runs the code it is said to.
"""

from __future__ import annotations

import http.client
import json
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from fakes import AUTH
from workloads import CRITERIA, make_state

REPO = Path(__file__).resolve().parent.parent
PATH = "/v1/systemone"
STATE_WORDS = 4  # with notes of 2-6 words: SmolLM2 prompts of ~125 tokens (the bare one is ~118)
NOTE_WORDS = (2, 6)
GIT_TIMEOUT_S = 120
LAUNCH = (
    "import runpy, sys, semif_serve; "
    "print('semif_serve imported from', semif_serve.__file__, flush=True); "
    "runpy.run_module('semif_serve', run_name='__main__', alter_sys=True)"
)


def item(seed: int, words: int = STATE_WORDS) -> dict:
    """One bulk item: a distinct state and one yes/no question, as a System One body."""
    return {
        "model": "jev-latest",
        "state": make_state(random.Random(seed), words, note_words=NOTE_WORDS),
        "questions": {"q": {"type": "noul", "instructions": CRITERIA[seed % len(CRITERIA)]}},
    }


def serve_command() -> list[str]:
    """`semif-serve serve` from whichever semif_serve PYTHONPATH names, logging which."""
    return [sys.executable, "-P", "-c", LAUNCH, "serve"]


def imported_from(log: str) -> str:
    """The semif_serve a server started by `serve_command` imported (its __init__.py)."""
    found = re.search(r"semif_serve imported from (\S+)", log)
    assert found, f"the launcher did not say which semif_serve it imported:\n{log[-2000:]}"
    return found.group(1)


@contextmanager
def worktree(ref: str) -> Iterator[Path]:
    """A detached git worktree of `ref` under /tmp, removed (forced) when the block ends."""
    parent = Path(tempfile.mkdtemp(prefix="semif-bench-baseline-", dir="/tmp"))
    tree = parent / "tree"
    try:
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), ref],
            check=True,
            capture_output=True,
            timeout=GIT_TIMEOUT_S,
        )
        yield tree
    finally:
        if tree.exists():
            subprocess.run(
                ["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)],
                capture_output=True,
                timeout=GIT_TIMEOUT_S,
            )
        shutil.rmtree(parent, ignore_errors=True)


def commit_of(ref: str) -> str:
    found = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", ref],
        check=True,
        capture_output=True,
        text=True,
        timeout=GIT_TIMEOUT_S,
    )
    return found.stdout.strip()


def post(port: int, body: dict, timeout_s: float) -> tuple[int, dict, dict[str, str]]:
    """One POST of `body` on a connection of its own: status, JSON reply, headers (lower-case)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request("POST", PATH, json.dumps(body).encode(), AUTH)
        response = connection.getresponse()
        reply = json.loads(response.read() or b"null")
        return response.status, reply, {k.lower(): v for k, v in response.getheaders()}
    finally:
        connection.close()


def retry_after_s(headers: dict[str, str]) -> float | None:
    """retry-after-ms in seconds, else Retry-After's whole seconds (None: neither is sent)."""
    if "retry-after-ms" in headers:
        return float(headers["retry-after-ms"]) / 1000
    if "retry-after" in headers:
        return float(headers["retry-after"])
    return None


@dataclass
class Answered:
    reply: dict
    retries: int
    seconds: float


def post_until_served(
    port: int, body: dict, bound_s: float, max_retries: int, timeout_s: float = 600
) -> Answered:
    """POST `body` until it is served: a 429 or 503 is retried after the reply's retry-after-ms
    (1 s when it names none), at most `max_retries` times and never past `bound_s` in all;
    anything else but a 200 fails at once."""
    started = time.monotonic()
    retries = 0
    while True:
        remaining = bound_s - (time.monotonic() - started)
        assert remaining > 0, f"not served within {bound_s} s ({retries} retries)"
        status, reply, headers = post(port, body, min(timeout_s, remaining))
        if status == 200:
            return Answered(reply, retries, time.monotonic() - started)
        assert status in (429, 503), f"{status}: {reply}"
        wait = retry_after_s(headers) or 1.0
        assert retries < max_retries, f"still refused after {retries} retries: {reply}"
        assert time.monotonic() + wait - started < bound_s, f"not served within {bound_s} s"
        retries += 1
        time.sleep(wait)


def probability(reply: dict) -> list[float]:
    """The question's option probabilities (the reply's x_semif block)."""
    return reply["answers"]["q"]["x_semif"]["probabilities"]


def metrics(port: int, timeout_s: float = 10) -> dict[str, float]:
    """/metrics' unlabelled and single-model samples by name (labels dropped)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        connection.request("GET", "/metrics")
        response = connection.getresponse()
        text = response.read().decode()
        assert response.status == 200, text[:500]
    finally:
        connection.close()
    samples = {}
    for line in text.splitlines():
        found = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})? (\S+)", line)
        if found:
            samples[found.group(1)] = float(found.group(2))
    return samples


def wait_for_in_progress(port: int, count: int, bound_s: float) -> dict[str, float]:
    """Poll /metrics until semif_requests_in_progress is `count`; that scrape's samples."""
    deadline = time.monotonic() + bound_s
    while True:
        samples = metrics(port)
        if samples.get("semif_requests_in_progress") == count:
            return samples
        assert time.monotonic() < deadline, (
            f"{samples.get('semif_requests_in_progress')} requests in progress after "
            f"{bound_s} s, not {count}"
        )
        time.sleep(0.005)
