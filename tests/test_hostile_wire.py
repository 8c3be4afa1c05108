"""Hostile callers on the wire against a real gunicorn on 127.0.0.1 (issue 21, findings 1-4):
replies that are never read, chunk extensions that dodge the body limit, a 100 Continue sent
before the request is known acceptable, and requests whose client has gone.

Every wait is bounded: sockets carry timeouts, and waits for the server poll a file, the log,
/metrics or the kernel's view of a connection (tests/hostile_clients.py) up to a deadline.
"""

import http.client
import json
import re
import select
import signal
import socket
import struct
import subprocess
import threading
import time

import pytest
from fakes import AUTH, TOKEN, WAIT_S, row
from hostile_clients import (
    TCP_CLOSE,
    TCP_CLOSE_WAIT,
    close_all,
    open_never_reading,
    tcp_state,
    wait_until_stalled,
)
from live_server import fake_server, wait_for_file

from semif_serve.server import EXIT_CUT_OFF

pytestmark = pytest.mark.server

AUTH_LINE = f"Authorization: Bearer {TOKEN}\r\n".encode()
MAX_QUEUE = 4
THREADS = MAX_QUEUE + 4  # SEMIF_MAX_QUEUE + the spares (semif_serve/server.py)
PROBE_S = 2  # a /health or /decide on an idle fake server takes milliseconds
STALL_S = 30  # for the server to answer all it can to the never-reading connections


# Reading replies from raw sockets -----------------------------------------------------------


class Replies:
    """Responses read one at a time from a raw socket; each recv waits the socket's timeout."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.data = b""

    def _more(self) -> None:
        chunk = self.sock.recv(65536)
        assert chunk, f"connection closed; received so far: {self.data[:300]!r}"
        self.data += chunk

    def head(self) -> tuple[int, dict[str, str], bytes]:
        """The next status line and headers: (status, lower-cased headers, the raw head)."""
        while b"\r\n\r\n" not in self.data:
            self._more()
        raw, _, self.data = self.data.partition(b"\r\n\r\n")
        lines = raw.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        return int(lines[0].split()[1]), headers, raw

    def body(self, headers: dict[str, str]) -> dict | None:
        """The JSON body that follows a head with these headers (Content-Length framed)."""
        length = int(headers["content-length"])
        while len(self.data) < length:
            self._more()
        body, self.data = self.data[:length], self.data[length:]
        return json.loads(body) if body else None

    def reply(self) -> tuple[int, dict[str, str], dict | None]:
        """The next response with its JSON body; a 1xx head is not skipped (it has no body)."""
        status, headers, _ = self.head()
        return status, headers, self.body(headers)


def get_text(server, path: str) -> str:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        assert response.status == 200
        return response.read().decode()
    finally:
        connection.close()


def metric(server, name: str) -> float | None:
    """A label-less sample of /metrics (None when the server does not export it)."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", get_text(server, "/metrics"), re.MULTILINE)
    return float(found.group(1)) if found else None


def wait_until(condition, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout} s")
        time.sleep(0.01)


def status_within(server, method: str, path: str, timeout: float, body=None, headers=None):
    """The status, or a sentence saying the server did not answer within `timeout`."""
    try:
        return server.request(method, path, body, headers, timeout=timeout)[0]
    except TimeoutError:
        return f"no reply to {method} {path} within {timeout} s"


def access_lines(server) -> list[dict]:
    return [
        json.loads(line)
        for line in server.log_text().splitlines()
        if line.startswith('{"request_id"')
    ]


# Finding 1: replies that are never read --------------------------------------------------------


def test_never_reading_pipelined_connections_hold_no_thread(tmp_path):
    # 3x as many connections as threads, each pipelining GET /metrics with a 4 KiB receive
    # buffer and never reading: each thread blocked in send() forever and /health froze.
    with fake_server(tmp_path, SEMIF_MAX_QUEUE=str(MAX_QUEUE)) as server:
        clients = open_never_reading(server.port, 3 * THREADS)
        try:
            reading = [client.conn for client in clients if not client.blocked]
            assert reading == [], "the server kept reading these; the test proves nothing"
            answered = wait_until_stalled(server.log_text, clients, STALL_S)
            # Not parsed ahead: of the ~3,000 requests each sent, only those whose replies fit
            # in the kernel's buffers (and the one pending) were answered.
            assert all(answered[client.conn] < client.sent for client in clients), answered
            for _ in range(3):  # fresh connections each, as a load balancer probes
                assert status_within(server, "GET", "/health", PROBE_S) == 200
            assert status_within(server, "POST", "/decide", PROBE_S, row(), AUTH) == 200
        finally:
            close_all(clients)


def test_a_reply_never_taken_within_the_write_timeout_is_reset_logged_and_counted(tmp_path):
    with fake_server(tmp_path, SEMIF_WRITE_TIMEOUT_S="1") as server:
        clients = open_never_reading(server.port, 1, prefix="unread")
        try:
            (client,) = clients
            assert client.blocked
            # A reset shows as TCP_CLOSE. A FIN queued behind the undelivered reply would never
            # reach a client that does not read; TCP_CLOSE_WAIT is accepted in case it did.
            wait_until(
                lambda: tcp_state(client.sock) in (TCP_CLOSE, TCP_CLOSE_WAIT),
                "the never-reading connection was not closed by the server",
                1 + WAIT_S,
            )
            undelivered = re.compile(r"request_id=unread-0-(\d+)\b")

            def logged() -> list[str]:
                text = server.log_text()
                return [line for line in text.splitlines() if "reply not delivered" in line]

            wait_until(logged, "no 'reply not delivered' line in the log")
            (line,) = logged()  # one connection, one reply not delivered
            assert "WARNING" in line
            found = undelivered.search(line)
            assert found and int(found.group(1)) < client.sent, line
            undelivered_total = metric(server, "semif_replies_undelivered_total")
            assert undelivered_total is not None and undelivered_total >= 1, undelivered_total
            assert status_within(server, "GET", "/health", PROBE_S) == 200
        finally:
            close_all(clients)


def test_sigterm_with_undelivered_replies_cuts_them_off_and_exits_non_zero(tmp_path):
    # The finding: SIGTERM waited for the master's own deadline (grace + 5 s), then exited 0
    # with no cut-off line, although the replies were never delivered.
    grace_s, margin_s, count = 2, 20, 3
    env = {"SEMIF_WRITE_TIMEOUT_S": "60", "SEMIF_GRACEFUL_TIMEOUT_S": str(grace_s)}
    with fake_server(tmp_path, **env) as server:
        clients = open_never_reading(server.port, count, prefix="term")
        try:
            assert all(client.blocked for client in clients)
            wait_until_stalled(server.log_text, clients, STALL_S)  # each has a reply pending
            server.process.send_signal(signal.SIGTERM)
            try:
                status = server.process.wait(grace_s + margin_s)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running {grace_s + margin_s} s after SIGTERM")
        finally:
            close_all(clients)
        assert status == EXIT_CUT_OFF  # `run` (serve_steered.py fake), as `semif-serve serve`
        cut = [
            line
            for line in server.log_text().splitlines()
            if "cut off" in line or "cut_off" in line
        ]
        named = {int(conn) for line in cut for conn in re.findall(r"\bterm-(\d+)-\d+\b", line)}
        assert named == set(range(count)), cut


# Findings 2 and 3: the body limit and 100 Continue ------------------------------------------

BODY_LIMIT = 65536
WIRE_SLACK = 65536  # wire bytes a body may take past SEMIF_MAX_BODY_BYTES (framing, extensions)


@pytest.fixture(scope="module")
def bodies(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bodies")
    with fake_server(folder, SEMIF_MAX_BODY_BYTES=str(BODY_LIMIT)) as live:
        yield live


def chunked_head() -> bytes:
    return (
        b"POST /decide HTTP/1.1\r\nHost: t\r\n"
        + AUTH_LINE
        + b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )


def test_chunk_extensions_count_against_the_body_limit(bodies):
    # The finding: one data byte per chunk with an 8 KB extension; only decoded bytes were
    # counted, so one connection pushed 3.2 GB in 15 s before the body deadline's 408.
    chunk = b"1;ext=" + b"x" * 8000 + b"\r\nx\r\n"
    most_bytes, most_s = 2 * 1024 * 1024, 15
    sent, answered = 0, False
    with bodies.connect(timeout=WAIT_S) as sock:
        sock.sendall(chunked_head())
        started = time.monotonic()
        while sent < most_bytes and time.monotonic() - started < most_s:
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                answered = True  # closed after its reply: read it below
                break
            sent += len(chunk)
            # One chunk, then up to 50 ms for a reply: paced like this, the server takes each
            # chunk as it comes and little waits in the kernel's buffers on either side.
            if select.select([sock], [], [], 0.05)[0]:
                answered = True
                break
        assert answered, f"no reply after {sent} bytes in {time.monotonic() - started:.1f} s"
        status, headers, body = Replies(sock).reply()
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert headers.get("connection") == "close"
    # The server may read BODY_LIMIT + WIRE_SLACK bytes (128 KiB) plus the recv that crossed
    # it: about one chunk, paced as above. `sent` also counts the chunk in flight when the
    # reply came and any the server had not taken yet: a chunk or two. 4 x the limit (256 KiB)
    # leaves ~15 chunks (0.75 s) of slack for a slow server, while one counting decoded bytes
    # only would need 65,536 chunks (~525 MB). Unpaced, the kernel's buffers on both sides
    # (autotuned up to MBs) would hide what the server read.
    read_at_most = BODY_LIMIT + WIRE_SLACK
    assert sent <= 4 * BODY_LIMIT, f"{sent} bytes sent; the server may read {read_at_most} + 1 recv"


def test_a_legitimate_chunked_body_under_the_limit_still_scores(bodies):
    payload = json.dumps(row()).encode()
    payload += b" " * (40_000 - len(payload))  # JSON whitespace: about 40 KB in 4 KB chunks
    body = b"".join(
        b"%x\r\n%s\r\n" % (len(piece), piece)
        for piece in (payload[i : i + 4096] for i in range(0, len(payload), 4096))
    )
    with bodies.connect(timeout=WAIT_S) as sock:
        sock.sendall(chunked_head() + body + b"0\r\n\r\n")
        status, _, reply = Replies(sock).reply()
    assert status == 200, reply
    assert reply["id"] == "r1"


def expect_continue_head(length: int, token: str = TOKEN) -> bytes:
    return (
        b"POST /decide HTTP/1.1\r\nHost: t\r\n"
        + f"Authorization: Bearer {token}\r\n".encode()
        + b"Content-Type: application/json\r\n"
        + f"Content-Length: {length}\r\nExpect: 100-continue\r\n\r\n".encode()
    )


def first_reply_without_a_body(server, head: bytes) -> tuple[int, dict, dict]:
    """Send only `head`; the first thing back must be the final reply, not a 100."""
    with server.connect(timeout=WAIT_S) as sock:
        sock.sendall(head)
        replies = Replies(sock)
        status, headers, raw = replies.head()
        assert status != 100, f"100 Continue before the request was known acceptable: {raw!r}"
        return status, headers, replies.body(headers)


def test_expect_continue_with_a_body_over_the_limit_is_a_final_413_at_once(bodies):
    status, headers, body = first_reply_without_a_body(
        bodies, expect_continue_head(100 * 1024 * 1024)
    )
    assert status == 413 and body["error"]["code"] == "request_too_large"
    assert headers.get("connection") == "close"


def test_expect_continue_with_a_wrong_token_is_a_final_401_at_once(bodies):
    status, headers, body = first_reply_without_a_body(
        bodies, expect_continue_head(200, token="w" * 40)
    )
    assert status == 401 and body["error"]["code"] == "unauthorized"
    assert headers.get("connection") == "close"


def test_expect_continue_on_an_acceptable_request_gets_100_then_200(bodies):
    payload = json.dumps(row()).encode()
    with bodies.connect(timeout=WAIT_S) as sock:
        sock.sendall(expect_continue_head(len(payload)))
        replies = Replies(sock)
        status, _, raw = replies.head()
        assert status == 100, raw
        sock.sendall(payload)
        status, _, body = replies.reply()
    assert status == 200 and body["id"] == "r1"


# Finding 4: requests whose client has gone --------------------------------------------------


def decide_request(request_id: str) -> bytes:
    payload = json.dumps(row(id=request_id)).encode()
    return (
        b"POST /decide HTTP/1.1\r\nHost: t\r\n"
        + AUTH_LINE
        + f"X-Request-Id: {request_id}\r\nContent-Type: application/json\r\n".encode()
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )


def test_requests_whose_client_left_while_queued_are_dropped_not_scored(tmp_path):
    # The finding: 8 /decide sent and their sockets closed at once were all scored and logged
    # as 200, and a live request waited behind them.
    with fake_server(tmp_path, gated=True) as server:
        control = tmp_path / "control"
        first = []
        thread = threading.Thread(
            target=lambda: first.append(server.request("POST", "/decide", row(), AUTH))
        )
        thread.start()
        try:
            wait_for_file(control / "entered-1")  # the scorer is busy with the first request
            gone = {
                "gone-fin-1": "fin",
                "gone-fin-2": "fin",
                "gone-rst-1": "rst",
                "gone-rst-2": "rst",
            }
            socks = {}
            for request_id in gone:
                socks[request_id] = server.connect(timeout=WAIT_S)
                socks[request_id].sendall(decide_request(request_id))
            for n in range(2, 2 + len(gone)):
                wait_for_file(control / f"admitted-{n}")
            # Admission comes before the body is read; the model's queue only after it, so
            # every body is in the server before any client leaves.
            wait_until(
                lambda: metric_labelled(server, "semif_model_queued_requests") == len(gone),
                "the abandoned requests never queued for the model",
            )
            for request_id, way in gone.items():
                if way == "rst":  # close() then resets instead of sending FIN
                    socks[request_id].setsockopt(
                        socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0)
                    )
                socks[request_id].close()
        finally:
            (control / "release").touch()
            thread.join(WAIT_S)
        assert first and first[0][0] == 200
        live = server.request(
            "POST", "/decide", row(id="live"), {**AUTH, "X-Request-Id": "live"}, timeout=WAIT_S
        )
        assert live[0] == 200
        entered = sorted(path.name for path in control.glob("entered-*"))
        assert entered == ["entered-1", "entered-2"], "an abandoned request was scored"
        assert metric(server, "semif_requests_abandoned_total") == len(gone)
        wait_until(
            lambda: (
                len([line for line in access_lines(server) if line["status"] == 499]) >= len(gone)
            ),
            "the abandoned requests' access lines",
        )
        dropped = [line for line in access_lines(server) if line["status"] == 499]
        assert sorted(line["request_id"] for line in dropped) == sorted(gone)
        assert {line.get("error") for line in dropped} == {"client_closed_request"}


def metric_labelled(server, name: str) -> float | None:
    """The one sample of a metric with labels (the default model's), None when absent."""
    found = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", get_text(server, "/metrics"), re.M)
    return float(found.group(1)) if found else None
