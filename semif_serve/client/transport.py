"""`DeadlineTransport`: httpx's HTTP transport for `Client`, with every socket operation ended by
the attempt's deadline.

httpx applies a timeout per phase (pool, connect, write, read), and within a phase per socket
operation: an attempt whose timeouts are all the time left can take several times it, and a
server that sends its reply a byte at a time can hold it for ever. `Client` marks each attempt
with `attempt_ends_in(time left)`; this transport's connections then give every connect, TLS
handshake, send and receive at most the time left until that end, and time out at once after
it, whatever the phase's own timeout. An attempt so ends within its time left plus the few
milliseconds between two socket operations; the exceptions are name resolution (the system's
resolver has no timeout) and a host name with several addresses, each of which may take the
time left that remained when its connect began. An IP address is exact.
(`AsyncClient` needs none of this: `asyncio.timeout` cancels the whole attempt.)

A transport passed to `Client(transport=...)`, and a proxy taken from the environment
(HTTP_PROXY), get httpx's per-phase timeouts only.
"""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import httpcore
import httpx

_ENDS: ContextVar[float | None] = ContextVar("semif_attempt_ends", default=None)


@contextmanager
def attempt_ends_in(seconds: float) -> Iterator[None]:
    """Socket operations of this thread's requests inside the block end within `seconds`."""
    token = _ENDS.set(time.monotonic() + seconds)
    try:
        yield
    finally:
        _ENDS.reset(token)


def _capped(timeout: float | None, timed_out: type[Exception]) -> float | None:
    """`timeout`, or the time left to the attempt's end when that is shorter; past the end,
    `timed_out` at once (a zero timeout would make the socket non-blocking, not time out)."""
    ends = _ENDS.get()
    if ends is None:
        return timeout
    left = ends - time.monotonic()
    if left <= 0:
        raise timed_out("the call's deadline has passed")
    return left if timeout is None else min(timeout, left)


class _Stream(httpcore.NetworkStream):
    def __init__(self, stream: httpcore.NetworkStream):
        self._stream = stream

    def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return self._stream.read(max_bytes, _capped(timeout, httpcore.ReadTimeout))

    def write(self, buffer: bytes, timeout: float | None = None) -> None:
        # One send() at a time, each capped anew: httpcore's own loop gives every partial send
        # the whole timeout, so a server that reads slowly could stretch one write past the end.
        sock: socket.socket = self._stream.get_extra_info("socket")
        view = memoryview(buffer)
        while view:
            capped = _capped(timeout, httpcore.WriteTimeout)
            try:
                sock.settimeout(capped)
                sent = sock.send(view)
            except TimeoutError as error:
                raise httpcore.WriteTimeout(error) from error
            except OSError as error:
                raise httpcore.WriteError(error) from error
            view = view[sent:]

    def close(self) -> None:
        self._stream.close()

    def start_tls(
        self,
        ssl_context: ssl.SSLContext,
        server_hostname: str | None = None,
        timeout: float | None = None,
    ) -> httpcore.NetworkStream:
        capped = _capped(timeout, httpcore.ConnectTimeout)
        return _Stream(self._stream.start_tls(ssl_context, server_hostname, capped))

    def get_extra_info(self, info: str) -> Any:
        return self._stream.get_extra_info(info)


class _Backend(httpcore.NetworkBackend):
    def __init__(self) -> None:
        self._backend = httpcore.SyncBackend()

    def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        capped = _capped(timeout, httpcore.ConnectTimeout)
        return _Stream(self._backend.connect_tcp(host, port, capped, local_address, socket_options))

    def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.NetworkStream:
        capped = _capped(timeout, httpcore.ConnectTimeout)
        return _Stream(self._backend.connect_unix_socket(path, capped, socket_options))

    def sleep(self, seconds: float) -> None:
        self._backend.sleep(seconds)


class DeadlineTransport(httpx.HTTPTransport):
    """`httpx.HTTPTransport()` with its defaults, on connections that end by the attempt's end;
    `socket_options` as httpx's (tests shrink the socket buffers with them)."""

    def __init__(self, socket_options: Iterable[Any] | None = None) -> None:
        # httpx.HTTPTransport takes no network backend, and its __init__ sets nothing but this
        # pool: the same pool (httpx's default limits and TLS context) is built here, on ours.
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
        self._pool = httpcore.ConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_Backend(),
            socket_options=socket_options,
        )
