"""Connections, counted from accept to close: a part of the worker (worker.py).

The worker holds at most SEMIF_MAX_CONNECTIONS connections (gunicorn's `worker_connections`);
past it, accepting stops and new ones wait in the kernel's backlog. Each connection is a file
descriptor: the soft open-file limit is raised to fit them, and running out of descriptors
pauses accepting for ACCEPT_PAUSE_S instead of spinning on the listening socket. A connection is
counted in by `accept`, which hands it to the head reader (heads.py), and counted out
by `drop`, whichever part closes it.
"""

from __future__ import annotations

import errno
import resource
import time

from gunicorn.workers.gthread import TConn

ACCEPT_PAUSE_S = 0.5  # out of file descriptors: stop accepting this long instead of spinning


class ConnectionAccounting:
    """Admission and counting of connections. Expects gthread's `nr_conns`,
    `worker_connections`, `_accepting` and `set_accept_enabled`, and the worker's
    `accept_resumes_at`, `limits`, `log` and `await_head`."""

    def admit_connections(self) -> None:
        """From the event loop: accept while under the limit and past any pause, else not."""
        can_accept = (
            self.nr_conns < self.worker_connections and time.monotonic() >= self.accept_resumes_at
        )
        if can_accept != self._accepting:
            self.set_accept_enabled(can_accept)

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

    def drop(self, conn: TConn) -> None:
        self.nr_conns -= 1
        conn.close()


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
