"""Slow, silent and short-changing clients against a real gunicorn on 127.0.0.1 (issue 13,
findings 3-5): no client may hold a thread or an admission slot past its read deadline, and a
body shorter than its Content-Length is refused, never scored.

One server for the module (SEMIF_MAX_QUEUE=2, so 6 threads; 1 s read deadlines). Its scorer
writes `entered-<n>` per call (the `release` file is made up front, so calls never wait). Every
wait is bounded; the /health timeouts are far above what a healthy server needs and far below
what a starved one took (5 s per silent connection, forever per stalled head).
"""

import contextlib
import json
import socket
import threading

import pytest
from fakes import AUTH, TOKEN, WAIT_S, row
from live_server import fake_server, read_response

pytestmark = pytest.mark.server

THREADS = 2 + 4  # SEMIF_MAX_QUEUE + the spares (semif_serve/server.py)
HEALTH_TIMEOUT_S = 3  # a starved worker answered after 5 s or never
AUTH_LINE = f"Authorization: Bearer {TOKEN}\r\n".encode()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("slow-clients")
    (folder / "control").mkdir()
    (folder / "control" / "release").touch()
    env = {
        "SEMIF_MAX_QUEUE": "2",
        "SEMIF_HEADER_TIMEOUT_S": "1",
        "SEMIF_BODY_TIMEOUT_S": "1",
    }
    with fake_server(folder, gated=True, **env) as live:
        live.control = folder / "control"
        yield live


@contextlib.contextmanager
def connections(server, count, first_bytes=b""):
    """`count` open connections that sent `first_bytes` (maybe nothing) and then stall."""
    socks = []
    try:
        for _ in range(count):
            sock = server.connect(timeout=WAIT_S)
            if first_bytes:
                sock.sendall(first_bytes)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def closed_by_server(sock) -> bool:
    """Whether the server closed `sock` (reading any reply first) within WAIT_S."""
    sock.settimeout(WAIT_S)
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def health(server) -> int:
    return server.request("GET", "/health", timeout=HEALTH_TIMEOUT_S)[0]


def scored(server) -> int:
    return len(list(server.control.glob("entered-*")))


def test_stalled_heads_and_silent_connections_leave_health_and_decide_answering(server):
    # Finding 3: 8 heads stalled mid-header (one byte a second never finishes) took every
    # thread forever; silent connections held one each for 5 s.
    stalled_head = b"POST /decide HTTP/1.1\r\nHost: t\r\nContent-Ty"
    with connections(server, 4 * THREADS, stalled_head) as stalled:
        with connections(server, 8 * THREADS):
            assert health(server) == 200
            assert (
                server.request("POST", "/decide", row(), AUTH, timeout=HEALTH_TIMEOUT_S)[0] == 200
            )
        # SEMIF_HEADER_TIMEOUT_S=1: the server closes each stalled head unanswered.
        assert all(closed_by_server(sock) for sock in stalled)


def post_head(length: int, path: str = "/decide", method: str = "POST") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: t\r\n".encode()
        + AUTH_LINE
        + f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n".encode()
    )


def test_a_body_that_stops_arriving_is_a_408_and_frees_its_admission_slot(server):
    # Finding 4: bodies that stall (a dripping client, or a Content-Length longer than what is
    # sent) held the SEMIF_MAX_QUEUE slots with no deadline, so every later /decide was a 429.
    with connections(server, 2, post_head(500) + b'{"id": "slow"') as held:
        replies = [read_response(sock) for sock in held]  # within SEMIF_BODY_TIMEOUT_S
        for status, body in replies:
            assert status == 408 and body["error"]["code"] == "request_timeout"
        assert all(closed_by_server(sock) for sock in held)  # answered with Connection: close
    assert server.request("POST", "/decide", row(), AUTH)[0] == 200


def test_a_body_shorter_than_its_content_length_is_a_400_and_never_scored(server):
    # Finding 5: a whole JSON object, a Content-Length 100 bytes larger, then a half-close.
    body = json.dumps(row()).encode()
    before = scored(server)
    with server.connect(timeout=WAIT_S) as sock:
        sock.sendall(post_head(len(body) + 100) + body)
        sock.shutdown(socket.SHUT_WR)
        raw = b""
        while chunk := sock.recv(65536):  # the server closes after its reply
            raw += chunk
    head, _, payload = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ")
    assert b"\r\nConnection: close\r\n" in head  # says what it does (said keep-alive before)
    reply = json.loads(payload)
    assert reply["error"]["code"] == "invalid_request"
    assert "ended after" in reply["error"]["message"]
    assert scored(server) == before


def test_a_malformed_chunked_body_is_a_400_envelope_not_a_500(server):
    with server.connect(timeout=WAIT_S) as sock:
        sock.sendall(
            b"POST /decide HTTP/1.1\r\nHost: t\r\n"
            + AUTH_LINE
            + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n"
        )
        status, body = read_response(sock)
    assert status == 400 and body["error"]["code"] == "bad_request"


def test_an_unread_dripping_body_holds_no_thread(server):
    # GET /health never reads a body; gthread waited up to 5 s for the rest of it per request.
    with connections(server, THREADS + 2, post_head(1000, "/health", "GET") + b"x") as dripping:
        for sock in dripping:
            assert read_response(sock)[0] == 200
        assert health(server) == 200
        assert all(closed_by_server(sock) for sock in dripping)


def test_clients_that_never_close_do_not_stall_the_event_loop(server):
    # gunicorn lingered up to 2 s per closing connection on the event loop's own thread.
    request = b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n"
    with connections(server, 10, request) as lingering:
        for sock in lingering:
            assert read_response(sock)[0] == 200
        assert health(server) == 200


def test_a_head_over_64_kib_is_a_431_envelope(server):
    headers = b"".join(b"X-Pad-%d: %s\r\n" % (n, b"p" * 8000) for n in range(9))
    with server.connect(timeout=WAIT_S) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n" + headers)
        status, body = read_response(sock)
    assert status == 431 and body["error"]["code"] == "headers_too_large"
    assert health(server) == 200


def test_many_clients_at_once_are_all_answered(server):
    """The head reader hands each complete request on exactly once, under concurrency."""
    results, barrier = [], threading.Barrier(20)

    def call():
        barrier.wait(WAIT_S)
        results.append(server.request("GET", "/health", timeout=WAIT_S)[0])

    threads = [threading.Thread(target=call) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT_S)
    assert results == [200] * 20
