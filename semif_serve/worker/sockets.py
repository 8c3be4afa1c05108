"""The client socket as the worker's request threads see it (worker.py).

- `DeadlineSocket`: reads end at the request's body deadline and stop at its wire-byte budget
  (chunk framing counted), and `100 Continue` goes out only when the body is first read;
- `ReplyBuffer`: where gunicorn writes a reply, so that the event loop, not a thread, sends it;
- `peer_gone`: whether the client has closed or reset its connection.
"""

from __future__ import annotations

import select
import socket
import time
from typing import Any

from semif_serve.errors import RequestTooLarge

CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
# Bytes a body may take on the wire beyond SEMIF_MAX_BODY_BYTES: chunk size lines and the like.
# A legitimate chunked body spends a few bytes per chunk; one that pads with chunk extensions
# (8 KB of them per 1-byte chunk) is refused once it has cost this much more than the limit.
WIRE_SLACK_BYTES = 64 * 1024


class DeadlineSocket:
    """The client socket as gunicorn's request parser sees it. A recv() waits until `deadline`
    (time.monotonic()) at most, then raises TimeoutError; once it has passed, only bytes that
    already arrived are taken. More than `wire_limit` bytes received for one request raise
    RequestTooLarge (a 413). With `continue_pending`, the first recv() first sends
    `100 Continue`: the app reads a body only once it has accepted the request (RFC 9110 10.1.1).
    Everything else goes to the socket itself."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline: float | None = None
        self.wire_limit: int | None = None
        self.received = 0
        self.continue_pending = False

    def start_request(self, deadline: float, wire_limit: int | None) -> None:
        self.deadline, self.wire_limit, self.received = deadline, wire_limit, 0
        self.continue_pending = False

    def recv(self, size: int) -> bytes:
        if self.deadline is None:
            return self.sock.recv(size)
        self.sock.settimeout(max(self.deadline - time.monotonic(), 0.0))
        try:
            if self.continue_pending:
                self.continue_pending = False
                self.sock.sendall(CONTINUE)
            data = self.sock.recv(size)
        except BlockingIOError:  # a zero timeout: nothing had arrived
            raise TimeoutError("the read deadline passed") from None
        finally:
            self.sock.settimeout(None)
        self.received += len(data)
        if self.wire_limit is not None and self.received > self.wire_limit:
            raise RequestTooLarge(
                f"the body took over {self.wire_limit} bytes on the wire (chunk framing counted)"
            )
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class ReplyBuffer:
    """Stands in for the client socket while gunicorn writes a reply: the bytes are kept, and the
    worker's event loop sends them within SEMIF_WRITE_TIMEOUT_S, so a client that never reads
    holds no thread. The buffer holds one reply: a connection's next request is not read before
    its reply is sent."""

    def __init__(self) -> None:
        self.data = bytearray()

    def sendall(self, data: bytes) -> None:
        self.data += data

    def send(self, data: bytes) -> int:
        self.data += data
        return len(data)


def peer_gone(sock: socket.socket) -> bool:
    """Whether the client closed (FIN) or reset its end. Bytes waiting to be read (a pipelined
    request) mean it is still there; so does nothing at all. Never waits: a socket with a
    timeout would wait that long in recv() for nothing to arrive, so poll() asks first."""
    try:
        readiness = select.poll()
        readiness.register(sock, select.POLLIN)
        if not readiness.poll(0):
            return False
        waiting = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return False
    except (OSError, ValueError):  # reset, or the socket is already closed (no descriptor)
        return True
    return waiting == b""
