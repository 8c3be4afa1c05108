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
- bounds the bytes a body takes on the wire (SEMIF_MAX_BODY_BYTES plus framing slack: a 413),
  and sends `100 Continue` only when the app reads the body (after auth, route and size);
- never waits for the unread body of a request the app answered without reading it, and says
  `Connection: close` when it will close;
- tells the app how to check that the client is still there (`semif.client_gone` in environ);
- sends every reply from the event loop, within SEMIF_WRITE_TIMEOUT_S (semif_serve/replies.py),
  and lingers on closing connections there too, never blocking a thread or the loop;
- holds at most SEMIF_MAX_CONNECTIONS connections; more wait in the kernel's backlog;
- on SIGTERM closes its listening sockets at once, and when SEMIF_GRACEFUL_TIMEOUT_S ends with
  requests still inside the app or replies still unsent, logs each, tells the master, and exits
  with EXIT_CUT_OFF.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import resource
import selectors
import sys
import time
from dataclasses import dataclass
from functools import partial
from typing import Any

from gunicorn import util as gunicorn_util
from gunicorn.http import wsgi
from gunicorn.workers.gthread import TConn, ThreadWorker

from semif_serve.http.errors import envelope
from semif_serve.replies import STOP_IDLE_LINGER_S, ReplyLoop
from semif_serve.sockets import (
    CLIENT_GONE_KEY,
    WIRE_SLACK_BYTES,
    DeadlineSocket,
    ReplyBuffer,
    peer_gone,
)

HEAD_MAX_BYTES = 64 * 1024  # request line and headers together; past it a 431
READ_BYTES = 8192  # one recv() of a head in the event loop
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


def start_response(resp, status: str, headers: list, exc_info: Any = None) -> Any:
    """The app's start_response. gunicorn drops hop-by-hop headers, so an app's
    `Connection: close` (a body it stopped reading) marks the reply as closing here."""
    for name, value in headers:
        if name.lower() == "connection" and value.strip().lower() == "close":
            resp.force_close()
    return resp.start_response(status, headers, exc_info)


@dataclass(frozen=True)
class ServingLimits:
    """What the worker enforces, from Settings; `cut_off` is shared with the master process
    (a multiprocessing.RawValue("i")) and receives the number of requests cut off."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    write_timeout_s: float = 30.0
    graceful_timeout_s: float = 60.0
    max_body_bytes: int | None = None  # None: no wire-byte budget for bodies
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


class SemifWorker(ReplyLoop, ThreadWorker):
    """gthread with bounded reads and a reporting shutdown (see the module docstring).

    A connection is in exactly one place: `reading` (its head, in the event loop), a thread
    (its request), `writing` (its reply, in the event loop) or `closing` (lingering for the
    peer's FIN). Each in `reading`, `writing` or `closing` has a `deadline`; `next_expiry` is the
    soonest, so the loop sweeps only when one is due.
    """

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = ServingLimits(graceful_timeout_s=self.cfg.graceful_timeout)
        self.reading: dict[TConn, None] = {}
        self.writing: dict[TConn, None] = {}
        self.closing: dict[TConn, None] = {}
        self.undelivered_at_stop = 0  # replies whose write deadline passed after SIGTERM
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
        """Close heads, replies and lingering closes past their deadline (a head is closed
        unanswered; a reply's connection is reset and reported)."""
        now = time.monotonic()
        if now < self.next_expiry:
            return
        soonest = math.inf
        for waiting, on_expiry in (
            (self.reading, self.abandon_head),
            (self.writing, partial(self.undelivered, why="SEMIF_WRITE_TIMEOUT_S passed")),
            (self.closing, self.end_closing),
        ):
            for conn in list(waiting):
                if conn.deadline <= now:
                    on_expiry(conn)
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

    # Requests, on the threads -------------------------------------------------------------

    def handle(self, conn: TConn):
        """Serve one request whose head the event loop read: give the parser those bytes and
        a socket whose reads end at the body deadline and at the body's wire-byte budget."""
        conn.sock.setblocking(True)
        conn.init()  # plain HTTP/1.1: only creates the parser
        unreader = conn.parser.unreader
        if not isinstance(unreader.sock, DeadlineSocket):
            unreader.sock = DeadlineSocket(unreader.sock)
        unreader.unread(bytes(conn.head))
        conn.head = None
        limit = self.limits.max_body_bytes
        unreader.sock.start_request(
            time.monotonic() + self.limits.body_timeout_s,
            None if limit is None else limit + WIRE_SLACK_BYTES,
        )
        return super().handle(conn)

    def handle_request(self, req, conn: TConn) -> bool:
        """Run the app for one request (on a thread) and keep its reply in `conn.reply` for the
        event loop to send (`send_reply`). `100 Continue` is sent only when the app reads the
        body. Before the reply's head is written, the connection is marked to close when the
        app said `Connection: close`, or left the body unread and its rest has not arrived (a
        401 or 413 before an upload). Returns whether the connection may serve another request.
        """
        conn.reader = conn.parser.unreader.sock
        conn.reader.continue_pending = req._expected_100_continue
        req._expected_100_continue = False  # else gunicorn sends it before the app runs
        conn.reply, conn.reply_id = ReplyBuffer(), None
        try:
            resp, environ = wsgi.create(req, conn.reply, conn.client, conn.server, self.cfg)
            environ["wsgi.multithread"] = True
            environ[CLIENT_GONE_KEY] = partial(peer_gone, conn.sock)
            if not self.alive:
                resp.force_close()
            respiter = self.wsgi(environ, partial(start_response, resp))
            try:
                if not self.body_settled(conn):
                    resp.force_close()
                for item in respiter:
                    resp.write(item)
                resp.close()
            finally:
                if hasattr(respiter, "close"):
                    respiter.close()
        except BaseException:
            conn.reply = None  # gunicorn answers the error itself; never half a reply
            raise
        conn.reply_id = dict((name.lower(), value) for name, value in resp.headers).get(
            "x-request-id"
        )
        return not resp.should_close()

    def body_settled(self, conn: TConn) -> bool:
        """Whether the request's body is read, or can be by taking only bytes that already
        arrived (at most BODY_DRAIN_BYTES). Never waits, never asks for a 100 Continue."""
        conn.reader.continue_pending = False
        conn.reader.deadline = time.monotonic()
        try:
            return bool(conn.parser.finish_body(max_bytes=BODY_DRAIN_BYTES))
        except Exception:  # a malformed or oversized rest: the connection closes
            return False

    def _keepalive_after(self, conn: TConn, keepalive: bool) -> bool:
        """gthread drains an unread body here, holding the thread up to 5 s; `handle_request`
        has already settled it without waiting."""
        return keepalive

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
        cut = self.undelivered_at_stop + self.cut_off_replies()
        in_progress = getattr(self.wsgi, "in_progress", None)
        if in_progress is not None:
            cut += in_progress.cut_off()
        if cut:
            self.exit_cut_off(cut)
        for conn in list(self.reading):
            self.stop_reading(conn)
            self.drop(conn)
        for conn in list(self.closing):
            self.end_closing(conn)
        self.tpool.shutdown(wait=False, cancel_futures=True)
        self.poller.close()
        self.method_queue.close()

    def exit_cut_off(self, count: int) -> None:
        """Tell the master how many requests were cut off (inside the app, or their replies
        undelivered) and exit now: the threads still serving some cannot be stopped, and the
        master kills us soon anyway."""
        self.log.error(
            "SEMIF_GRACEFUL_TIMEOUT_S (%ss) ended with %d request(s) in progress or undelivered:"
            " cut off",
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
