"""The gunicorn worker that owns the model: gthread's thread pool, with every client read bounded.

gunicorn's gthread worker gives each new connection to a thread, which parses the request on a
blocking socket with no deadline, so a few slow or silent clients hold every thread and /health
stops answering (issue 13). This worker keeps gthread's pool and event loop but:

- reads each request's head (request line and headers) in the event loop, costing no thread,
  until it is complete (then a thread serves the request), SEMIF_HEADER_TIMEOUT_S passes (the
  connection is closed) or it grows past HEAD_MAX_BYTES (431); a kept-alive connection's next
  request likewise;
- bounds every body read of a request by SEMIF_BODY_TIMEOUT_S from the end of its head
  (http/body.py turns the timeout into a 408, a body ending early into a 400);
- never waits for the unread body of a request the app answered without reading it;
- lingers on closing connections inside the event loop instead of blocking it;
- holds at most SEMIF_MAX_CONNECTIONS connections; more wait in the kernel's backlog;
- on SIGTERM closes its listening sockets at once, and when SEMIF_GRACEFUL_TIMEOUT_S ends with
  requests still inside the app, logs each, tells the master, and exits with EXIT_CUT_OFF.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import resource
import selectors
import socket
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any

from gunicorn import util as gunicorn_util
from gunicorn.workers.gthread import TConn, ThreadWorker

from semif_serve.http.errors import envelope

HEAD_MAX_BYTES = 64 * 1024  # request line and headers together; past it a 431
READ_BYTES = 8192  # one recv() of a head in the event loop
STOP_IDLE_LINGER_S = 2.0  # on SIGTERM, an idle connection may still start one request (gthread's)
CLOSE_LINGER_S = 2.0  # how long a closing connection waits for the peer's FIN (RFC 9112 9.6)
CLOSE_DRAIN_BYTES = 64 * 1024  # what a closing connection reads and discards at most
BODY_DRAIN_BYTES = 64 * 1024  # an unread body discarded to keep the connection alive, at most
ACCEPT_PAUSE_S = 0.5  # out of file descriptors: stop accepting this long instead of spinning
EXIT_CUT_OFF = 5  # the worker's (and `semif-serve serve`'s) status when requests were cut off

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


@dataclass(frozen=True)
class ServingLimits:
    """What the worker enforces, from Settings; `cut_off` is shared with the master process
    (a multiprocessing.RawValue("i")) and receives the number of requests cut off."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    graceful_timeout_s: float = 60.0
    cut_off: Any = None


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


class DeadlineSocket:
    """The client socket as gunicorn's request parser sees it: a recv() waits until `deadline`
    (time.monotonic()) at most, then raises TimeoutError; once it has passed, only bytes that
    already arrived are taken. Everything else goes to the socket itself."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.deadline: float | None = None

    def recv(self, size: int) -> bytes:
        if self.deadline is None:
            return self.sock.recv(size)
        self.sock.settimeout(max(self.deadline - time.monotonic(), 0.0))
        try:
            return self.sock.recv(size)
        except BlockingIOError:  # a zero timeout: nothing had arrived
            raise TimeoutError("the read deadline passed") from None
        finally:
            self.sock.settimeout(None)  # the response is written blocking, as gthread does

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sock, name)


class SemifWorker(ThreadWorker):
    """gthread with bounded reads and a reporting shutdown (see the module docstring).

    A connection is in exactly one place: `reading` (its head, in the event loop), a thread
    (its request), or `closing` (lingering for the peer's FIN). Each in `reading` or `closing`
    has a `deadline`; `next_expiry` is the soonest, so the loop sweeps only when one is due.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = ServingLimits(graceful_timeout_s=self.cfg.graceful_timeout)
        self.reading: dict[TConn, None] = {}
        self.closing: dict[TConn, None] = {}
        self.next_expiry = math.inf
        self.accept_resumes_at = 0.0

    def configure(self, limits: ServingLimits) -> None:
        """Called from gunicorn's post_fork hook (semif_serve/server.py), before init_process."""
        self.limits = limits

    def init_process(self) -> None:
        gunicorn_util.write_error = write_envelope_error  # this process serves only semif-serve
        raise_open_file_limit(self.worker_connections + 256, self.log)
        super().init_process()

    # The event loop -----------------------------------------------------------------------

    def run(self) -> None:
        self.poller.register(
            self.method_queue.fileno(), selectors.EVENT_READ, self.method_queue.run_callbacks
        )
        while self.alive:
            self.notify()
            can_accept = (
                self.nr_conns < self.worker_connections
                and time.monotonic() >= self.accept_resumes_at
            )
            if can_accept != self._accepting:
                self.set_accept_enabled(can_accept)
            self.wait_for_and_dispatch_events(timeout=self.next_wake(1.0))
            if not self.is_parent_alive():
                break
            self.expire()
        self.shut_down()

    def next_wake(self, most: float) -> float:
        return max(0.0, min(most, self.next_expiry - time.monotonic()))

    def watch(self, conn: TConn, deadline: float) -> None:
        conn.deadline = deadline
        self.next_expiry = min(self.next_expiry, deadline)

    def expire(self) -> None:
        """Close heads and lingering closes past their deadline (a head is closed unanswered)."""
        now = time.monotonic()
        if now < self.next_expiry:
            return
        soonest = math.inf
        for conn in list(self.reading):
            if conn.deadline <= now:
                self.stop_reading(conn)
                self.drop(conn)
            else:
                soonest = min(soonest, conn.deadline)
        for conn in list(self.closing):
            if conn.deadline <= now:
                self.end_closing(conn)
            else:
                soonest = min(soonest, conn.deadline)
        self.next_expiry = soonest

    def accept(self, listener) -> None:
        try:
            client, address = listener.accept()
        except OSError as error:
            if error.errno in (errno.EMFILE, errno.ENFILE):
                self.log.warning("out of file descriptors; not accepting for %ss", ACCEPT_PAUSE_S)
                self.accept_resumes_at = time.monotonic() + ACCEPT_PAUSE_S
                self.set_accept_enabled(False)
            elif error.errno not in (errno.EAGAIN, errno.ECONNABORTED, errno.EWOULDBLOCK):
                raise
            return
        self.nr_conns += 1
        conn = TConn(self.cfg, client, address, listener.getsockname())  # non-blocking
        self.await_head(conn, b"", time.monotonic() + self.limits.header_timeout_s)

    # Heads, in the event loop -------------------------------------------------------------

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
            self.stop_reading(conn)
            self.drop(conn)
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

    def stop_reading(self, conn: TConn) -> None:
        if conn in self.reading:
            del self.reading[conn]
            self.poller.unregister(conn.sock)

    # Requests, on the threads -------------------------------------------------------------

    def handle(self, conn: TConn):
        """Serve one request whose head the event loop read: give the parser those bytes and
        a socket whose reads end at the body deadline."""
        conn.sock.setblocking(True)
        conn.init()  # plain HTTP/1.1: only creates the parser
        unreader = conn.parser.unreader
        if not isinstance(unreader.sock, DeadlineSocket):
            unreader.sock = DeadlineSocket(unreader.sock)
        unreader.unread(bytes(conn.head))
        conn.head = None
        unreader.sock.deadline = time.monotonic() + self.limits.body_timeout_s
        return super().handle(conn)

    def _keepalive_after(self, conn: TConn, keepalive: bool) -> bool:
        """Keep the connection only when the rest of an unread body has already arrived
        (gthread waits up to 5 s for it, holding a thread, e.g. for a dripping GET body)."""
        if not keepalive:
            return False
        conn.parser.unreader.sock.deadline = time.monotonic()  # take only what is here
        return bool(conn.parser.finish_body(max_bytes=BODY_DRAIN_BYTES))

    def finish_request(self, conn: TConn, future: Future) -> None:
        """Back on the loop: wait for the next request on a kept-alive connection, else close."""
        try:
            keep = bool(not future.cancelled() and future.result())
            if keep:
                conn.sock.setblocking(False)
                pending = conn.parser.unreader.take_buffered()  # a pipelined request's start
        except Exception:
            keep = False
        if not keep:
            self.close_gracefully(conn)
            return
        now = time.monotonic()
        if pending:
            deadline = now + self.limits.header_timeout_s
        else:
            deadline = now + self.cfg.keepalive
            if not self.alive:
                deadline = min(deadline, now + STOP_IDLE_LINGER_S)
        self.await_head(conn, pending, deadline, idle=not pending)

    # Closing, in the event loop -----------------------------------------------------------

    def close_gracefully(self, conn: TConn) -> None:
        """gunicorn's util.close_graceful without blocking the loop: send FIN, then discard what
        the peer still sends until it closes too, so unread bytes never turn the close into a
        reset that could cut the response short."""
        try:
            conn.sock.shutdown(socket.SHUT_WR)
            conn.sock.setblocking(False)
        except OSError:
            self.drop(conn)
            return
        conn.drained = 0
        self.watch(conn, time.monotonic() + CLOSE_LINGER_S)
        self.closing[conn] = None
        self.poller.register(
            conn.sock, selectors.EVENT_READ, partial(self.on_closing_readable, conn)
        )

    def on_closing_readable(self, conn: TConn, _sock) -> None:
        try:
            data = conn.sock.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        conn.drained += len(data)
        if not data or conn.drained >= CLOSE_DRAIN_BYTES:
            self.end_closing(conn)

    def end_closing(self, conn: TConn) -> None:
        if conn in self.closing:
            del self.closing[conn]
            self.poller.unregister(conn.sock)
        self.drop(conn)

    def drop(self, conn: TConn) -> None:
        self.nr_conns -= 1
        conn.close()

    # Shutdown -----------------------------------------------------------------------------

    def shut_down(self) -> None:
        """Refuse new connections at once, let requests finish within the grace period, then
        cut off and report whatever is still inside the app."""
        started = time.monotonic()
        self.set_accept_enabled(False)
        for listener in self.sockets:  # the master closed its copies before signalling us
            listener.close()
        grace_ends = started + self.limits.graceful_timeout_s
        for conn in self.reading:
            limit = grace_ends if conn.head else min(grace_ends, started + STOP_IDLE_LINGER_S)
            self.watch(conn, min(conn.deadline, limit))
        while self.nr_conns > 0 and time.monotonic() < grace_ends:
            self.notify()
            self.wait_for_and_dispatch_events(
                timeout=self.next_wake(min(1.0, grace_ends - time.monotonic()))
            )
            self.expire()
        in_progress = getattr(self.wsgi, "in_progress", None)
        if in_progress is not None and len(in_progress):
            self.cut_off(in_progress)
        for conn in list(self.reading):
            self.stop_reading(conn)
            self.drop(conn)
        for conn in list(self.closing):
            self.end_closing(conn)
        self.tpool.shutdown(wait=False, cancel_futures=True)
        self.poller.close()
        self.method_queue.close()

    def cut_off(self, in_progress) -> None:
        """Log each request the grace period cut off, tell the master, and exit now: the
        threads still serving them cannot be stopped, and the master kills us soon anyway."""
        count = in_progress.cut_off()
        self.log.error(
            "SEMIF_GRACEFUL_TIMEOUT_S (%ss) ended with %d request(s) in progress: cut off",
            self.limits.graceful_timeout_s,
            count,
        )
        if self.limits.cut_off is not None:
            self.limits.cut_off.value = count
        logging.shutdown()
        sys.stderr.flush()
        os._exit(EXIT_CUT_OFF)


def raise_open_file_limit(wanted: int, log) -> None:
    """Each connection is a file descriptor: lift the soft limit (often 1024) toward `wanted`."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    if target < wanted:
        log.warning("open-file limit %s is below SEMIF_MAX_CONNECTIONS + 256 (%s)", target, wanted)
