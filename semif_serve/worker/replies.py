"""Replies and closes in the worker's event loop: a part of the worker (worker.py).

A request thread leaves its reply in `conn.reply` (a sockets.ReplyBuffer); the loop sends it on
the non-blocking socket as the client takes it, so a client that never reads holds no thread.
A reply not taken within SEMIF_WRITE_TIMEOUT_S resets its connection and is logged with its
request id and counted (`semif_replies_undelivered_total`); while it is pending the connection's
next (pipelined) request is not read. A closing connection lingers for the client's FIN here too.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import time
from concurrent.futures import Future
from functools import partial

from gunicorn.workers.gthread import TConn

STOP_IDLE_LINGER_S = 2.0  # on SIGTERM, an idle connection may still start one request (gthread's)
CLOSE_LINGER_S = 2.0  # how long a closing connection waits for the peer's FIN (RFC 9112 9.6)
CLOSE_DRAIN_BYTES = 64 * 1024  # what a closing connection reads and discards at most
RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets, dropping unsent bytes


class ReplyLoop:
    """The event loop's half of a connection after its request: `writing` its reply, then
    reading the next head (`await_head`, heads.py) or `closing`. Expects gthread's
    `poller`, `log`, `wsgi`, `cfg` and `alive`, the worker's `limits`, `writing`, `closing`,
    `undelivered_at_stop` and `watch`, and `drop` (connections.py)."""

    def finish_request(self, conn: TConn, future: Future) -> None:
        """Back on the loop: send the reply, then serve the connection's next request or
        close it."""
        try:
            keep = bool(not future.cancelled() and future.result())
        except Exception:
            keep = False
        reply, conn.reply = getattr(conn, "reply", None), None
        if reply is None or not reply.data:
            self.after_reply(conn, keep)
            return
        conn.out, conn.keep = memoryview(reply.data), keep  # no copy: nothing writes it now
        try:
            conn.sock.setblocking(False)
        except OSError:
            self.drop(conn)
            return
        if not self.write_some(conn):
            self.watch(conn, time.monotonic() + self.limits.write_timeout_s)
            self.writing[conn] = None
            self.poller.register(conn.sock, selectors.EVENT_WRITE, partial(self.on_writable, conn))

    def after_reply(self, conn: TConn, keep: bool) -> None:
        """Wait for the next request on a kept-alive connection, else close it."""
        if keep:
            try:
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

    # Replies, in the event loop -----------------------------------------------------------

    def on_writable(self, conn: TConn, _sock) -> None:
        self.write_some(conn)

    def write_some(self, conn: TConn) -> bool:
        """Send what the socket takes now. True when the reply is done with (sent, or its
        connection dropped), False when the rest must wait for the client to read."""
        try:
            sent = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            self.undelivered(conn, "the client reset the connection")
            return True
        conn.out = conn.out[sent:]
        if conn.out:
            return False
        self.stop_writing(conn)
        self.after_reply(conn, conn.keep)
        return True

    def stop_writing(self, conn: TConn) -> None:
        if conn in self.writing:
            del self.writing[conn]
            self.poller.unregister(conn.sock)

    def undelivered(self, conn: TConn, why: str) -> None:
        """A reply the client did not take: reset the connection, log and count it."""
        self.stop_writing(conn)
        self.log.warning(
            "reply not delivered (%s): request_id=%s, %d bytes unsent",
            why,
            conn.reply_id,
            len(conn.out),
        )
        metrics = getattr(self.wsgi, "metrics", None)
        if metrics is not None:
            metrics.reply_undelivered()
        if not self.alive and conn.deadline <= time.monotonic():
            self.undelivered_at_stop += 1
        self.reset(conn)

    def reset(self, conn: TConn) -> None:
        with contextlib.suppress(OSError):
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
        self.drop(conn)

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

    def cut_off_replies(self) -> int:
        """Log and reset each reply still being written when the grace period ended."""
        stuck = list(self.writing)
        for conn in stuck:
            self.stop_writing(conn)
            self.log.error(
                "reply cut off by the shutdown: request_id=%s, %d bytes unsent",
                conn.reply_id,
                len(conn.out),
            )
            self.reset(conn)
        return len(stuck)
