"""Clients that pipeline requests and never read a reply (issue 21, finding 1), for
tests/test_hostile_wire.py and bench/test_health_under_slow_clients.py; 127.0.0.1 only.

Each connection has a small receive buffer and announces a small MSS (both set before
connecting: Linux sizes the server's send buffer from the MSS, so a connection stalls after about
20 /metrics replies instead of about 500), and sends `GET <path>` requests back to back on a
non-blocking socket until the server stops taking them: its send buffer stays full for SETTLE_S.
`wait_until_stalled` then watches the server's access log until it answers none of them any more.
A server that stops reading a connection whose reply is pending, and one whose thread is stuck
writing that reply, look the same from here; what the tests check is what the server does next.
"""

from __future__ import annotations

import contextlib
import re
import selectors
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

RCVBUF_BYTES = 4096  # the kernel doubles it: about 8 KiB of replies fill the client's buffer
SNDBUF_BYTES = 16384  # a fixed send buffer (no autotuning): sends block soon once unread
MSS_BYTES = 1024  # the segment size announced to the server
BATCH = 64  # requests handed to one send()
SETTLE_S = 0.5  # a send buffer full this long: the server is not reading this connection
TCP_ESTABLISHED, TCP_CLOSE, TCP_CLOSE_WAIT = 1, 7, 8  # include/net/tcp_states.h


def tcp_state(sock: socket.socket) -> int:
    """The connection's TCP state, read from the kernel (Linux TCP_INFO, its first byte) without
    touching the bytes queued on it: a client that never reads still learns it was reset
    (TCP_CLOSE) or that the server sent its FIN (TCP_CLOSE_WAIT)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


def request_id(prefix: str, conn: int, seq: int) -> str:
    return f"{prefix}-{conn}-{seq}"


@dataclass(eq=False)
class NeverReading:
    """One connection; its requests' ids are `prefix-conn-<seq>`, seq from 0."""

    sock: socket.socket
    path: str
    prefix: str
    conn: int
    made: int = 0  # requests built so far
    pending: bytes = b""  # built, not yet taken by the kernel
    blocked: bool = False  # the kernel took no more: the server is not reading
    reset: bool = False  # the server closed it while we were still sending

    @property
    def sent(self) -> int:
        """Requests whose every byte the kernel took (each in `pending` ends with one blank line)."""
        return self.made - self.pending.count(b"\r\n\r\n")

    def next_batch(self) -> bytes:
        lines = []
        for seq in range(self.made, self.made + BATCH):
            rid = request_id(self.prefix, self.conn, seq)
            lines.append(f"GET {self.path} HTTP/1.1\r\nHost: t\r\nX-Request-Id: {rid}\r\n\r\n")
        self.made += BATCH
        return "".join(lines).encode()

    def push(self, most: int) -> None:
        """Send until the kernel takes no more (blocked) or `most` requests were sent."""
        while True:
            if not self.pending:
                if self.made >= most:
                    return
                self.pending = self.next_batch()
            try:
                taken = self.sock.send(self.pending)
            except BlockingIOError:
                self.blocked = True
                return
            except (BrokenPipeError, ConnectionResetError):
                self.blocked = self.reset = True
                return
            self.pending = self.pending[taken:]


def open_never_reading(
    port: int,
    count: int,
    paths: tuple[str, ...] = ("/metrics",),
    prefix: str = "stuck",
    most: int = 20_000,
    budget_s: float = 60.0,
) -> list[NeverReading]:
    """`count` connections (path i % len(paths)) that pipeline up to `most` requests each and
    never read. Returns once every connection's send buffer stayed full for SETTLE_S, each
    reached `most`, or `budget_s` passed (the caller checks `blocked`)."""
    clients = []
    try:
        for number in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF_BYTES)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF_BYTES)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, MSS_BYTES)
            clients.append(NeverReading(sock, paths[number % len(paths)], prefix, number))
            sock.settimeout(10)
            sock.connect(("127.0.0.1", port))
            sock.setblocking(False)
        deadline = time.monotonic() + budget_s
        with selectors.DefaultSelector() as selector:
            for client in clients:
                client.push(most)
                if client.blocked and not client.reset:
                    selector.register(client.sock, selectors.EVENT_WRITE, client)
            while selector.get_map() and time.monotonic() < deadline:
                ready = selector.select(min(SETTLE_S, max(deadline - time.monotonic(), 0)))
                if not ready:
                    break  # every remaining send buffer stayed full for SETTLE_S
                for key, _ in ready:
                    client = key.data
                    client.blocked = False
                    client.push(most)
                    if client.reset or not client.blocked:
                        selector.unregister(client.sock)  # closed, or it reached `most`
    except BaseException:
        close_all(clients)
        raise
    return clients


def wait_until_stalled(
    log_text: Callable[[], str], clients: list[NeverReading], timeout: float
) -> Counter:
    """Requests answered per connection (access log lines with its ids), once some were and the
    counts stayed the same for SETTLE_S: the server answers none of them any more. Sends
    blocking is not enough: a server still working through the other connections' requests
    stops reading this one's for a while, too. (A server whose threads are all stuck answers
    nothing more, even to connections it never reached: not every connection need appear.)"""
    prefix = re.escape(clients[0].prefix)
    pattern = re.compile(rf'"request_id": "{prefix}-(\d+)-\d+"')
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        counts = Counter(int(conn) for conn in pattern.findall(log_text()))
        now = time.monotonic()
        if counts != last:
            last, since = counts, now
        elif counts and now - since >= SETTLE_S:
            return counts
        assert now < deadline, f"still answering after {timeout} s: {sorted(counts.items())}"
        time.sleep(0.05)


def close_all(clients: list[NeverReading]) -> None:
    for client in clients:
        with contextlib.suppress(OSError):
            client.sock.close()
