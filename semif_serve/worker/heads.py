"""Request heads, read in the worker's event loop: a part of the worker (worker.py).

gunicorn's gthread gives each new connection to a thread, which parses the request on a blocking
socket with no deadline, so a few slow or silent clients hold every thread and /health stops
answering (issue 13). Here a request's head (request line and headers) is read without a thread
until it is complete (then a thread serves the request: handling.py), its deadline
passes (the connection is closed unanswered) or it grows past HEAD_MAX_BYTES (a 431). The
deadline is SEMIF_HEADER_TIMEOUT_S; a kept-alive connection's next request waits here too, under
the keep-alive limit until its first byte arrives. gunicorn's own refusals of a head it cannot
parse are written in the JSON envelope too (`write_envelope_error`).
"""

from __future__ import annotations

import contextlib
import selectors
import time
from functools import partial

from gunicorn import util as gunicorn_util
from gunicorn.workers.gthread import TConn

from semif_serve.http.errors import envelope

HEAD_MAX_BYTES = 64 * 1024  # request line and headers together; past it a 431
READ_BYTES = 8192  # one recv() of a head in the event loop

GUNICORN_ERROR_CODES = {
    400: "bad_request",
    403: "forbidden",
    414: "uri_too_long",
    417: "expectation_failed",
    431: "headers_too_large",
    501: "not_implemented",
}


def write_envelope_error(sock, status_int: int, reason: str, message: str) -> None:
    """gunicorn's own error replies (a request it cannot parse) in the JSON envelope too."""
    code = GUNICORN_ERROR_CODES.get(status_int, "internal_error")
    body = envelope(code, message or reason).encode("utf-8")
    head = (
        f"HTTP/1.1 {status_int} {reason}\r\nConnection: close\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    gunicorn_util.write_nonblock(sock, head.encode("latin-1") + body)


def head_ready(head: bytes | bytearray, start: int = 0) -> bool:
    """Whether gunicorn's parser can decide on `head` without reading more: it holds the blank
    line that ends a head, or a bare LF, which the parser rejects. `start`: bytes already
    searched, so a head sent a byte at a time costs linear time."""
    if head.find(b"\r\n\r\n", max(start - 3, 0)) >= 0:
        return True
    newline = head.find(b"\n", start)
    while newline >= 0:
        if newline == 0 or head[newline - 1] != 0x0D:
            return True
        newline = head.find(b"\n", newline + 1)
    return False


class HeadReading:
    """Connections in `reading` (the worker's dict), their heads arriving in the event loop,
    each under its `deadline`. Expects gthread's `poller` and `enqueue_req`, the worker's
    `limits` and `watch`, `drop` (connections.py) and `close_gracefully`
    (replies.py)."""

    def await_head(self, conn: TConn, data: bytes, deadline: float, idle: bool = False) -> None:
        """`idle`: a kept-alive connection; `deadline` is its idle limit until a byte arrives."""
        conn.head, conn.idle = bytearray(data), idle
        if self.head_done(conn, 0):
            return
        self.watch(conn, deadline)
        self.reading[conn] = None
        self.poller.register(conn.sock, selectors.EVENT_READ, partial(self.on_head_readable, conn))

    def on_head_readable(self, conn: TConn, _sock) -> None:
        try:
            data = conn.sock.recv(READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the peer closed (or reset) before a whole head arrived
            self.abandon_head(conn)
            return
        if conn.idle:  # the first byte of a kept-alive connection's next request
            conn.idle = False
            self.watch(conn, time.monotonic() + self.limits.header_timeout_s)
        searched = len(conn.head)
        conn.head += data
        self.head_done(conn, searched)

    def head_done(self, conn: TConn, searched: int) -> bool:
        """Hand a complete head to a thread, or refuse one too large; False: keep reading."""
        if head_ready(conn.head, searched):
            end = conn.head.find(b"\r\n\r\n")
            if end < 0 or end + 4 <= HEAD_MAX_BYTES:
                self.stop_reading(conn)
                self.enqueue_req(conn)
                return True
        elif len(conn.head) <= HEAD_MAX_BYTES:
            return False
        self.stop_reading(conn)
        message = f"the request line and headers are over {HEAD_MAX_BYTES} bytes"
        with contextlib.suppress(OSError):  # the client may be gone already
            write_envelope_error(conn.sock, 431, "Request Header Fields Too Large", message)
        self.close_gracefully(conn)
        return True

    def abandon_head(self, conn: TConn) -> None:
        self.stop_reading(conn)
        self.drop(conn)

    def stop_reading(self, conn: TConn) -> None:
        if conn in self.reading:
            del self.reading[conn]
            self.poller.unregister(conn.sock)
