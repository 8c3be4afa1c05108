"""The worker's pure pieces, without gunicorn running: when a head is complete enough to hand to
a thread, and the socket whose reads end at the body deadline (semif_serve/worker/worker.py)."""

import socket
import threading
import time

import pytest

from semif_serve.worker.sockets import DeadlineSocket
from semif_serve.worker.worker import head_ready


@pytest.mark.parametrize(
    "head",
    [
        b"GET /health HTTP/1.1\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n",
        b"POST /decide HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",  # body bytes after the head
        b"\r\nGET / HTTP/1.1\r\n\r\n",  # the one empty line RFC 9112 allows first
        b"GET / HTTP/1.1\n",  # a bare LF: gunicorn refuses it without reading more
        b"GET / HTTP/1.1\r\nHost: t\n",
        b"\n",
    ],
)
def test_a_head_is_ready_at_its_blank_line_or_at_a_bare_lf(head):
    assert head_ready(head)


@pytest.mark.parametrize(
    "head",
    [
        b"",
        b"G",
        b"GET /health HTTP/1.1\r\n",
        b"GET /health HTTP/1.1\r\nHost: t\r\n",
        b"GET /health HTTP/1.1\r\nHost: t\r\n\r",
    ],
)
def test_a_head_without_its_blank_line_is_not_ready(head):
    assert not head_ready(head)


def test_a_head_arriving_a_byte_at_a_time_is_ready_exactly_at_its_last_byte():
    head = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
    received = bytearray()
    for count, byte in enumerate(head, start=1):
        searched = len(received)
        received.append(byte)
        assert head_ready(received, searched) == (count == len(head))


def test_the_search_resumes_across_a_split_blank_line():
    head = bytearray(b"GET / HTTP/1.1\r\nHost: t\r\n\r")
    searched = len(head)
    head += b"\n"
    assert head_ready(head, searched)


def test_a_read_waits_no_longer_than_the_deadline(pair):
    reader = DeadlineSocket(pair[0])
    reader.deadline = time.monotonic() + 0.05
    # A read that ignored the deadline would get these bytes 3 s later instead of timing out.
    watchdog = threading.Timer(3, pair[1].sendall, (b"late",))
    watchdog.start()
    try:
        with pytest.raises(TimeoutError):
            reader.recv(10)
    finally:
        watchdog.cancel()
    assert pair[0].gettimeout() is None  # blocking again, for the response


def test_past_the_deadline_only_bytes_already_there_are_taken(pair):
    reader = DeadlineSocket(pair[0])
    reader.deadline = time.monotonic() - 1
    pair[1].sendall(b"here")
    assert reader.recv(10) == b"here"
    watchdog = threading.Timer(3, pair[1].sendall, (b"late",))  # a read that waited gets these
    watchdog.start()
    try:
        with pytest.raises(TimeoutError, match="^the read deadline passed$"):  # at once
            reader.recv(10)
    finally:
        watchdog.cancel()
    assert pair[0].gettimeout() is None


def test_without_a_deadline_reads_block_as_before_and_the_rest_passes_through(pair):
    reader = DeadlineSocket(pair[0])
    pair[1].sendall(b"x")
    assert reader.recv(1) == b"x"
    assert reader.fileno() == pair[0].fileno()
    pair[1].shutdown(socket.SHUT_WR)
    reader.deadline = time.monotonic() + 5
    assert reader.recv(1) == b""  # the peer's close is not a timeout
