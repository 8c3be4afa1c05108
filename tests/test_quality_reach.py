"""Every command that talks to a server asks `/health` first, under a short deadline: a wrong
port or a server that never answers is one line and exit 2 within seconds, not after
--timeout-s (600 s by default) of retried connections."""

import socket
import time

import pytest
from fakes import FakeScorer
from quality_fakes import ServedApp, labelled_rows, token_file, write_jsonl

from semif_serve.cli import main
from semif_serve.quality.reach import REACH_DEADLINE_S, answers, unreachable

# The most a command may take past the deadline: parsing, reading files, closing.
SLACK_S = 2.0


@pytest.fixture
def refused_url():
    """A port bound on 127.0.0.1 but never listening: every connection to it is refused."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def silent_url():
    """A listening port that never accepts: connections complete, requests get no reply."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


def timed(call):
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def test_health_answers_from_a_server_and_from_anything_that_replies_over_http():
    with ServedApp(FakeScorer()) as server:
        assert answers(server.url)
        assert answers(server.url + "/no/such/prefix")  # a 404 is a reply: something is there


def test_no_server_or_a_silent_one_is_told_within_the_deadline(refused_url, silent_url):
    reply, elapsed = timed(lambda: answers(refused_url, deadline_s=1.0))
    assert reply is False and elapsed < 1.0 + SLACK_S
    reply, elapsed = timed(lambda: answers(silent_url, deadline_s=0.5))
    assert reply is False and elapsed < 0.5 + SLACK_S
    assert answers("localhost:8471", deadline_s=0.5) is False  # no scheme: nothing to reach
    assert unreachable("http://h:1") == "cannot reach http://h:1 (start the server, or pass --url)"


def command(name, url, tmp_path):
    data = tmp_path / "rows.jsonl"
    write_jsonl(data, labelled_rows())
    server = ["--url", url, "--token-file", str(token_file(tmp_path))]
    if name == "accept":
        return ["accept", *server, "--data", str(data)]
    if name == "evaluate":
        return ["evaluate", "--data", str(data), *server]
    out = str(tmp_path / "c.json")
    return ["calibrate", "--data", str(data), "--workload", "w", "--out", out, *server]


@pytest.mark.parametrize("name", ["accept", "evaluate", "calibrate"])
def test_a_command_pointed_at_no_server_says_so_in_seconds(name, refused_url, tmp_path, capsys):
    status, elapsed = timed(lambda: main(command(name, refused_url, tmp_path)))  # --timeout-s 600
    assert status == 2
    assert capsys.readouterr().err.splitlines() == [
        f"semif-serve: error: cannot reach {refused_url} (start the server, or pass --url)"
    ]
    assert elapsed < REACH_DEADLINE_S + SLACK_S
    assert not (tmp_path / "c.json").exists()


def test_a_server_that_never_answers_stops_accept_at_the_deadline(silent_url, tmp_path, capsys):
    status, elapsed = timed(lambda: main(command("accept", silent_url, tmp_path)))
    assert status == 2
    assert capsys.readouterr().err.splitlines() == [
        f"semif-serve: error: cannot reach {silent_url} (start the server, or pass --url)"
    ]
    assert REACH_DEADLINE_S <= elapsed < REACH_DEADLINE_S + SLACK_S


def test_a_shorter_timeout_s_shortens_the_check_too(silent_url, tmp_path, capsys):
    args = [*command("evaluate", silent_url, tmp_path), "--timeout-s", "0.5"]
    status, elapsed = timed(lambda: main(args))
    assert status == 2 and "cannot reach" in capsys.readouterr().err
    assert elapsed < 0.5 + SLACK_S
