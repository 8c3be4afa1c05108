"""The client socket as the worker's threads see it (semif_serve/worker/sockets.py), on socketpairs:
the wire-byte budget of a body, `100 Continue` at the first body read, the reply buffer, and the
check for a client that has gone (issue 21)."""

import socket
import struct
import threading
import time
from contextlib import contextmanager

import pytest

from semif_serve.errors import RequestTooLarge
from semif_serve.worker.sockets import CONTINUE, DeadlineSocket, ReplyBuffer, peer_gone


def test_a_new_reader_has_no_deadline_no_budget_and_no_continue(pair):
    reader = DeadlineSocket(pair[0])
    assert (reader.deadline, reader.wire_limit, reader.received, reader.continue_pending) == (
        None,
        None,
        0,
        False,
    )


def reader_for(sock, wire_limit=None) -> DeadlineSocket:
    reader = DeadlineSocket(sock)
    reader.start_request(time.monotonic() + 5, wire_limit)
    return reader


def test_a_body_may_take_exactly_its_wire_budget(pair):
    reader = reader_for(pair[0], wire_limit=6)
    pair[1].sendall(b"abcdef")
    assert reader.recv(4) == b"abcd"
    assert reader.recv(4) == b"ef"
    assert reader.received == 6


def test_one_byte_over_the_wire_budget_is_a_413(pair):
    reader = reader_for(pair[0], wire_limit=6)
    pair[1].sendall(b"abcdefg")
    assert reader.recv(6) == b"abcdef"
    with pytest.raises(RequestTooLarge, match="over 6 bytes on the wire"):
        reader.recv(6)
    assert pair[0].gettimeout() is None  # blocking again, for the error reply


def test_without_a_budget_any_number_of_bytes_is_read(pair):
    reader = reader_for(pair[0])
    pair[1].sendall(b"x" * 1000)
    assert len(reader.recv(1000)) == 1000


def test_each_request_starts_a_new_budget_and_no_pending_continue(pair):
    reader = reader_for(pair[0], wire_limit=4)
    pair[1].sendall(b"abcd")
    reader.recv(4)
    reader.continue_pending = True
    reader.start_request(time.monotonic() + 5, 4)
    assert (reader.received, reader.wire_limit, reader.continue_pending) == (0, 4, False)
    pair[1].sendall(b"efgh")
    assert reader.recv(4) == b"efgh"  # no 100 Continue sent, no 413
    pair[1].setblocking(False)
    with pytest.raises(BlockingIOError):
        pair[1].recv(100)


@contextmanager
def after_3_s(action, *args):
    """A watchdog: a check that wrongly waits sees `action` happen instead of hanging."""
    watchdog = threading.Timer(3, action, args)
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def test_start_request_sets_the_read_deadline(pair):
    reader = DeadlineSocket(pair[0])
    reader.start_request(time.monotonic() + 0.05, None)
    with after_3_s(pair[1].sendall, b"late"), pytest.raises(TimeoutError):
        reader.recv(1)


def test_a_pending_continue_goes_out_once_at_the_first_body_read(pair):
    reader = reader_for(pair[0])
    reader.continue_pending = True
    pair[1].sendall(b"body")
    assert reader.recv(2) == b"bo"
    assert reader.continue_pending is False
    assert pair[1].recv(100) == CONTINUE
    assert reader.recv(2) == b"dy"
    pair[1].setblocking(False)
    with pytest.raises(BlockingIOError):  # sent once only
        pair[1].recv(100)
    assert CONTINUE == b"HTTP/1.1 100 Continue\r\n\r\n"


def test_the_reply_buffer_keeps_everything_written_in_order():
    buffer = ReplyBuffer()
    buffer.sendall(b"HTTP/1.1 200 OK\r\n")
    buffer.sendall(b"\r\n")
    assert buffer.send(b"{}") == 2
    assert bytes(buffer.data) == b"HTTP/1.1 200 OK\r\n\r\n{}"


def test_a_connected_quiet_client_is_not_gone_at_once(pair):
    pair[0].settimeout(1)  # a check that blocked would time out (gone), not hang the test
    with after_3_s(pair[1].shutdown, socket.SHUT_WR):  # a check that waited would see a FIN
        assert peer_gone(pair[0]) is False


def test_a_readiness_that_vanishes_before_the_peek_means_still_there(pair):
    class Raced:  # poll() saw bytes; another reader took them before the peek
        def fileno(self):
            return pair[0].fileno()

        def recv(self, size, flags):
            raise BlockingIOError

    pair[1].sendall(b"x")
    assert peer_gone(Raced()) is False


def test_a_client_with_a_pipelined_request_is_not_gone_and_keeps_its_bytes(pair):
    pair[1].sendall(b"GET /health HTTP/1.1\r\n\r\n")
    pair[1].shutdown(socket.SHUT_WR)  # bytes before the FIN: still a request to answer
    pair[0].settimeout(1)
    assert peer_gone(pair[0]) is False
    assert pair[0].recv(100) == b"GET /health HTTP/1.1\r\n\r\n"


def test_a_client_that_closed_is_gone(pair):
    pair[1].shutdown(socket.SHUT_WR)
    assert peer_gone(pair[0]) is True


def test_a_client_that_reset_is_gone():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
        with server:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            client.close()  # RST
            deadline = time.monotonic() + 5
            while not peer_gone(server):
                assert time.monotonic() < deadline, "the reset never showed"
                time.sleep(0.01)


def test_a_closed_socket_is_gone():
    left, right = socket.socketpair()
    right.close()
    left.close()
    assert peer_gone(left) is True
