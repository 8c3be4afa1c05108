"""The service under a real gunicorn on 127.0.0.1: threads, admission, body limit, framing,
shutdown. Each test starts and stops its own server; every wait is bounded."""

import http.client
import json
import select
import signal
import threading
import time

import pytest
from fakes import AUTH, TOKEN, WAIT_S, row
from live_server import fake_server, read_response, wait_for_file

from semif_serve.server import EXIT_CUT_OFF

pytestmark = pytest.mark.server

AUTH_LINE = f"Authorization: Bearer {TOKEN}\r\n".encode()


def post_in_thread(server, body=None):
    responses = []

    def call():
        responses.append(server.request("POST", "/decide", body or row(), AUTH))

    thread = threading.Thread(target=call)
    thread.start()
    return thread, responses


def test_health_answers_within_a_second_while_a_scorer_call_is_blocked(tmp_path):
    with fake_server(tmp_path, gated=True) as server:
        control = tmp_path / "control"
        thread, responses = post_in_thread(server)
        wait_for_file(control / "entered-1")
        started = time.monotonic()
        status, body, _ = server.request("GET", "/health", timeout=1)
        assert status == 200 and body["status"] == "ok"
        assert time.monotonic() - started < 1
        (control / "release").touch()
        thread.join(WAIT_S)
        assert responses[0][0] == 200


def test_past_max_queue_a_third_post_gets_429_before_sending_its_body(tmp_path):
    with fake_server(tmp_path, gated=True, SEMIF_MAX_QUEUE="2") as server:
        control = tmp_path / "control"
        held = [post_in_thread(server), post_in_thread(server)]
        wait_for_file(control / "admitted-1")
        wait_for_file(control / "admitted-2")
        with server.connect() as sock:
            sock.sendall(
                b"POST /decide HTTP/1.1\r\nHost: test\r\n"
                + AUTH_LINE
                + b"Content-Type: application/json\r\nContent-Length: 500\r\n\r\n"
            )  # headers only: the body is never sent
            status, body = read_response(sock)
        assert status == 429 and body["error"]["code"] == "busy"
        assert not (control / "admitted-3").exists()
        (control / "release").touch()
        for thread, responses in held:
            thread.join(WAIT_S)
            assert responses[0][0] == 200


def test_a_client_streaming_past_the_body_limit_gets_413_and_the_server_stops_reading(tmp_path):
    with fake_server(tmp_path, SEMIF_MAX_BODY_BYTES="1000") as server:
        chunk = b"200\r\n" + b"x" * 512 + b"\r\n"
        sent = 0  # chunks sent when the reply arrived
        with server.connect() as sock:
            sock.sendall(
                b"POST /decide HTTP/1.1\r\nHost: test\r\n"
                + AUTH_LINE
                + b"Transfer-Encoding: chunked\r\n\r\n"
            )
            for attempt in range(1, 201):  # at most ~100 KiB
                sent = attempt
                try:
                    sock.sendall(chunk)
                except (BrokenPipeError, ConnectionResetError):
                    break
                if select.select([sock], [], [], 0.05)[0]:
                    break
            status, body = read_response(sock)
        assert status == 413 and body["error"]["code"] == "request_too_large"
        assert sent < 200, "the server kept reading the whole upload"
        assert server.request("GET", "/health")[0] == 200


@pytest.mark.parametrize("length", ["١٠", "+10", "1_0"])
def test_a_content_length_of_unicode_digits_gets_a_4xx_envelope_and_the_worker_stays_up(
    tmp_path, length
):
    with fake_server(tmp_path) as server:
        with server.connect() as sock:
            sock.sendall(
                b"POST /decide HTTP/1.1\r\nHost: test\r\n"
                + AUTH_LINE
                + b"Content-Length: "
                + length.encode()
                + b"\r\n\r\n"
                + b'{"id": "x"}'
            )
            status, body = read_response(sock)
        assert 400 <= status < 500 and body["error"]["code"] == "bad_request"
        assert server.request("GET", "/health")[0] == 200
        assert "Worker exiting" not in server.log_text()


def test_sigterm_while_a_request_is_scoring_lets_it_finish(tmp_path):
    with fake_server(tmp_path, gated=True) as server:
        control = tmp_path / "control"
        thread, responses = post_in_thread(server)
        wait_for_file(control / "entered-1")
        server.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT_S
        while "Handling signal: term" not in server.log_text():
            assert time.monotonic() < deadline, "gunicorn never handled the SIGTERM"
            time.sleep(0.01)
        (control / "release").touch()
        thread.join(WAIT_S)
        assert responses and responses[0][0] == 200
        assert server.process.wait(WAIT_S * 3) == 0


def test_sigterm_refuses_new_connections_at_once_and_reports_requests_it_cuts_off(tmp_path):
    # Issue 13, finding 6: after SIGTERM new connections were accepted and left hanging, and a
    # request still running when the grace period ended vanished: no log line, exit status 0.
    grace_s = 4
    with fake_server(tmp_path, gated=True, SEMIF_GRACEFUL_TIMEOUT_S=str(grace_s)) as server:
        control = tmp_path / "control"
        outcome = []

        def call():  # the scorer is never released: this request outlives the grace period
            headers = {**AUTH, "X-Request-Id": "cut-1"}
            try:
                outcome.append(server.request("POST", "/decide", row(), headers, timeout=WAIT_S))
            except (OSError, http.client.HTTPException) as error:
                outcome.append(error)

        thread = threading.Thread(target=call)
        thread.start()
        wait_for_file(control / "entered-1")
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while True:  # gunicorn only stopped accepting: the kernel kept queueing connections
            try:
                server.connect(timeout=1).close()
            except ConnectionRefusedError:
                break
            assert time.monotonic() < signalled + grace_s / 2, "still accepting after SIGTERM"
            time.sleep(0.01)
        assert outcome == [], "refused only once the drain was over"
        assert server.process.wait(WAIT_S) == EXIT_CUT_OFF
        thread.join(WAIT_S)
        assert isinstance(outcome[0], Exception)  # the connection closed without a reply
        lines = [json.loads(line) for line in server.log_text().splitlines() if "cut_off" in line]
        assert [
            (line["request_id"], line["method"], line["route"], line["status"]) for line in lines
        ] == [("cut-1", "POST", "/decide", None)]


def test_health_says_draining_once_sigterm_began_the_shutdown(tmp_path):
    """Issue 43: a balancer probing a kept-alive connection during the drain read 200 "ok"
    from a server about to stop; now 503 "draining", and the connection closes."""
    with fake_server(tmp_path) as server, server.connect(timeout=WAIT_S) as sock:
        probe = b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
        sock.sendall(probe)
        status, body = read_response(sock)
        assert (status, body["status"], body.get("reason")) == (200, "ok", None)
        server.process.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        while status == 200:  # until the worker has been told (each reply keeps the connection)
            assert time.monotonic() < signalled + WAIT_S, "never draining"
            sock.sendall(probe)
            status, body = read_response(sock)
        assert (status, body["status"], body["reason"]) == (503, "unavailable", "draining")
        assert sock.recv(1) == b""  # its last request: the worker closed the connection
        assert server.process.wait(WAIT_S) == 0


def test_unknown_routes_through_gunicorn_get_the_envelope(tmp_path):
    with fake_server(tmp_path) as server:
        status, body, headers = server.request(
            "GET", "/nowhere", headers={**AUTH, "X-Request-Id": "r-1"}
        )
        assert status == 404 and body["error"]["code"] == "not_found"
        assert headers["x-request-id"] == "r-1"
        assert '"route": "/nowhere", "status": 404' in server.log_text()


def test_head_health_through_gunicorn_sends_no_body_and_the_connection_serves_a_get_next(tmp_path):
    # Issue 21, finding 6: load balancers probe with HEAD, which was a 405.
    with fake_server(tmp_path) as server, server.connect(timeout=WAIT_S) as sock:
        sock.sendall(b"HEAD /health HTTP/1.1\r\nHost: t\r\n\r\n")
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            assert chunk, f"closed before the HEAD's reply: {data!r}"
            data += chunk
        head, _, extra = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        assert lines[0] == "HTTP/1.1 200 OK" and headers["content-type"] == "application/json"
        assert headers.get("connection") != "close"
        assert extra == b"" and select.select([sock], [], [], 0.5)[0] == []  # no body follows
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n")
        status, body = read_response(sock)
        assert status == 200 and body["status"] == "ok"
        assert int(headers["content-length"]) == len(json.dumps(body, ensure_ascii=False).encode())
    assert '"method": "HEAD", "route": "/health", "status": 200' in server.log_text()
