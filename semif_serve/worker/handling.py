"""One request on a thread of gthread's pool: a part of the worker (worker.py).

The event loop has read the request's head (heads.py); here a thread parses it and
runs the app:
- every body read ends at SEMIF_BODY_TIMEOUT_S from the end of the head (http/body.py turns the
  timeout into a 408, a body ending early into a 400) and stops at the bytes a body may take on
  the wire (SEMIF_MAX_BODY_BYTES plus framing slack: a 413), through sockets.DeadlineSocket;
- `100 Continue` goes out only when the app reads the body (after auth, route and size);
- the unread body of a request the app answered without reading it is never waited for, and the
  reply says `Connection: close` when the connection will close;
- the app can ask whether the client is still there (`semif.client_gone` in environ);
- the reply is kept in a sockets.ReplyBuffer for the event loop to send (replies.py).
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from gunicorn.http import wsgi
from gunicorn.workers.gthread import TConn

from semif_serve.http.environ import CLIENT_GONE_KEY, DRAINING_KEY
from semif_serve.worker.sockets import (
    WIRE_SLACK_BYTES,
    DeadlineSocket,
    ReplyBuffer,
    peer_gone,
)

BODY_DRAIN_BYTES = 64 * 1024  # an unread body discarded to keep the connection alive, at most


def start_response(resp, status: str, headers: list, exc_info: Any = None) -> Any:
    """The app's start_response. gunicorn drops hop-by-hop headers, so an app's
    `Connection: close` (a body it stopped reading) marks the reply as closing here."""
    for name, value in headers:
        if name.lower() == "connection" and value.strip().lower() == "close":
            resp.force_close()
    return resp.start_response(status, headers, exc_info)


class RequestHandling:
    """gthread's `handle` and `handle_request` with bounded body reads and a kept reply.
    Expects gthread's `wsgi`, `cfg` and `alive`, and the worker's `limits`."""

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
        event loop to send (`finish_request`, replies.py). `100 Continue` is sent
        only when the app reads the body. Before the reply's head is written, the connection is
        marked to close when the app said `Connection: close`, or left the body unread and its
        rest has not arrived (a 401 or 413 before an upload). Returns whether the connection may
        serve another request.
        """
        conn.reader = conn.parser.unreader.sock
        conn.reader.continue_pending = req._expected_100_continue
        req._expected_100_continue = False  # else gunicorn sends it before the app runs
        conn.reply, conn.reply_id = ReplyBuffer(), None
        try:
            resp, environ = wsgi.create(req, conn.reply, conn.client, conn.server, self.cfg)
            environ["wsgi.multithread"] = True
            environ[CLIENT_GONE_KEY] = partial(peer_gone, conn.sock)
            if not self.alive:  # shutting down: this connection's last request
                resp.force_close()
                environ[DRAINING_KEY] = True
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
