"""semif_serve.client: round trips, the error envelope and retries against the real server
(tests/serve_steered.py fake under gunicorn), an httpx MockTransport where a real server cannot give
a status on demand, and a raw socket server that is slow on purpose. Time is a fake clock
wherever the client would wait: no test sleeps."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import sys
import threading
import time
from email.utils import formatdate

import httpx
import pytest
from fakes import TOKEN, WAIT_S, decision, row
from live_server import fake_server, wait_for_file

from semif_serve.client import (
    ApiError,
    AsyncClient,
    Client,
    ConnectionFailed,
    InvalidReply,
    RetryPolicy,
)
from semif_serve.client.retry import (
    MAX_SERVER_TIMEOUT_S,
    Attempts,
    body_timeout_s,
    parse_retry_after,
)
from semif_serve.client.transport import DeadlineTransport
from semif_serve.client.wire import attempt_body, prepare
from semif_serve.runtime.service import MAX_TIMEOUT_S
from semif_serve.session import SESSION_HEADER
from semif_serve.state_key import STATE_KEY_HEADER, state_key

MODES = ["sync", "async"]
# No call in these tests waits longer (its retries' schedule is fixed: not WAIT_S, which
# mutation/run lowers).
BOUNDED = RetryPolicy(deadline_s=30.0)
SHARE = 30.0 - 1.0  # its deadline less its margin (1 s): a body's first timeout_s
URL = "http://semif.test"
STATE = {"ticket": "Drucker im 3. Stock klemmt", "reporter": "Ana"}


class FakeTime:
    """A monotonic clock that moves only when the client sleeps; every sleep is recorded.
    `oversleep`: each sleep lasts that much longer than asked (a suspended process)."""

    def __init__(self, oversleep: float = 0.0) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []
        self.oversleep = oversleep

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds + self.oversleep

    async def asleep(self, seconds: float) -> None:
        self.sleep(seconds)


def run(mode: str, action, *, url: str = URL, token: str | None = TOKEN, **options):
    """`action(client)` on a Client, or awaited on an AsyncClient, closed afterwards."""
    options.setdefault("policy", BOUNDED)
    if mode == "sync":
        with Client(url, token, **options) as client:
            return action(client)

    async def main():
        async with AsyncClient(url, token, **options) as client:
            return await action(client)

    return asyncio.run(main())


def timing(fake: FakeTime, mode: str, draw: float = 0.0) -> dict:
    return {
        "clock": fake,
        "sleep": fake.sleep if mode == "sync" else fake.asleep,
        "random": lambda: draw,
    }


# -- the real server ------------------------------------------------------------------------------


class Recording(httpx.HTTPTransport):
    """The real network, remembering each request, its reply and the local port it used."""

    def __init__(self) -> None:
        super().__init__()
        self.exchanges: list[tuple[httpx.Request, httpx.Response, int]] = []

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        self._remember(request, response)
        return response

    def _remember(self, request, response) -> None:
        local = response.extensions["network_stream"].get_extra_info("client_addr")
        self.exchanges.append((request, response, local[1]))


class AsyncRecording(httpx.AsyncHTTPTransport):
    def __init__(self) -> None:
        super().__init__()
        self.exchanges: list[tuple[httpx.Request, httpx.Response, int]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        response = await super().handle_async_request(request)
        Recording._remember(self, request, response)
        return response


def recording(mode: str):
    return Recording() if mode == "sync" else AsyncRecording()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with fake_server(tmp_path_factory.mktemp("client")) as live:
        yield live


def url_of(server) -> str:
    return f"http://127.0.0.1:{server.port}"


def access_records(server) -> dict[str, dict]:
    """The server's JSON access-log lines, by request id."""
    records = {}
    for line in server.log_text().splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            records[record["request_id"]] = record
    return records


@pytest.mark.server
@pytest.mark.parametrize("mode", MODES)
def test_health_and_models_round_trip(server, mode):
    async def both(client):  # an AsyncClient's calls, awaited in turn
        return await client.health(), await client.models()

    if mode == "sync":
        health, models = run(mode, lambda c: (c.health(), c.models()), url=url_of(server))
    else:
        health, models = run(mode, both, url=url_of(server))
    assert health["status"] == "ok" and health["max_decisions"] >= 1
    assert health["model"]["id"] == "default" and "source" not in health["model"]
    assert [model["id"] for model in models["models"]] == ["default"]


@pytest.mark.server
@pytest.mark.parametrize("mode", MODES)
def test_decide_sends_the_state_key_the_server_answers_with(server, mode):
    transport = recording(mode)
    body = row(state=STATE)
    result = run(mode, lambda c: c.decide(body), url=url_of(server), transport=transport)
    assert result["id"] == "r1" and result["option_ids"] == ["o0", "o1"]
    assert abs(sum(result["probabilities"]) - 1) < 1e-9
    ((request, response, _),) = transport.exchanges
    assert request.headers[STATE_KEY_HEADER] == state_key(STATE)
    assert response.headers[STATE_KEY_HEADER] == state_key(STATE)
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    sent = json.loads(request.content)
    assert 0 < sent.pop("timeout_s") <= SHARE  # the server's share of the deadline, accepted
    assert sent == body


@pytest.mark.server
@pytest.mark.parametrize("mode", MODES)
def test_decide_shared_round_trips_in_request_order(server, mode):
    transport = recording(mode)
    body = {"state": STATE, "decisions": [decision("b"), decision("a", orderings="rotations")]}
    reply = run(mode, lambda c: c.decide_shared(body), url=url_of(server), transport=transport)
    assert [result["id"] for result in reply["results"]] == ["b", "a"]
    assert "combined" in reply["results"][1] and "timing" in reply
    ((request, response, _),) = transport.exchanges
    assert request.headers[STATE_KEY_HEADER] == response.headers[STATE_KEY_HEADER]
    assert response.headers[STATE_KEY_HEADER] == state_key(STATE)


@pytest.mark.server
def test_one_client_reuses_one_connection(server):
    transport = Recording()
    with Client(url_of(server), TOKEN, policy=BOUNDED, transport=transport) as client:
        client.health()
        client.decide(row())
        client.models()
    ports = {port for _, _, port in transport.exchanges}
    assert len(transport.exchanges) == 3 and len(ports) == 1


@pytest.mark.server
@pytest.mark.parametrize("mode", MODES)
def test_a_wrong_token_is_an_api_error_401(server, mode):
    fake = FakeTime()
    with pytest.raises(ApiError) as caught:
        run(mode, lambda c: c.models(), url=url_of(server), token="x" * 40, **timing(fake, mode))
    error = caught.value
    assert (error.status, error.code) == (401, "unauthorized")
    assert error.message == "missing or wrong bearer token"
    assert access_records(server)[error.request_id]["status"] == 401
    assert fake.sleeps == []


@pytest.mark.server
@pytest.mark.parametrize("mode", MODES)
def test_a_422_carries_the_envelope_and_request_id_and_is_never_retried(server, mode):
    fake, transport = FakeTime(), recording(mode)
    body = row(options=("only one",))
    with pytest.raises(ApiError) as caught:
        run(mode, lambda c: c.decide(body), url=url_of(server), transport=transport,
            **timing(fake, mode))  # fmt: skip
    error = caught.value
    assert (error.status, error.code) == (422, "invalid_request")
    assert error.message == "options: must hold 2..16 items, got 1"
    assert len(error.request_id) == 32
    record = access_records(server)[error.request_id]
    assert (record["status"], record["route"]) == (422, "/decide")
    assert len(transport.exchanges) == 1 and fake.sleeps == []
    assert "422 invalid_request: options" in str(error) and error.request_id in str(error)


@pytest.mark.parametrize("mode", MODES)
def test_no_server_listening_is_retried_until_the_deadline_then_connection_failed(mode):
    fake = FakeTime()
    with socket.socket() as held:  # bound, never listening: no other server can take the port
        held.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(ConnectionFailed, match="cannot reach the server"):
            run(mode, lambda c: c.health(), url=url, **timing(fake, mode))
    # The backoff up to its 10 s cap; a wait from 25.75 s would end past the 30 s deadline.
    assert fake.sleeps == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0]


@pytest.mark.server
@pytest.mark.parametrize("mode", MODES)
def test_a_timeout_s_the_server_refuses_is_sent_as_the_caller_gave_it(server, mode):
    body = row(timeout_s=-1)
    with pytest.raises(ApiError) as caught:
        run(mode, lambda c: c.decide(body), url=url_of(server))
    assert (caught.value.status, caught.value.code) == (422, "invalid_request")
    assert caught.value.message.startswith("timeout_s: must be a number of seconds")


class Blocker:
    """One POST /decide to a gated fake server, held inside the scorer until released.
    Each blocker closes the gate first, so one server serves one blocker after another."""

    def __init__(self, gated):
        server, self.control = gated
        (self.control / "release").unlink(missing_ok=True)
        entered = len(list(self.control.glob("entered-*")))
        self.replies = []
        self.thread = threading.Thread(
            target=lambda: self.replies.append(
                server.request("POST", "/decide", row(), {"Authorization": f"Bearer {TOKEN}"})
            )
        )
        self.thread.start()
        wait_for_file(self.control / f"entered-{entered + 1}")

    def release(self) -> None:
        (self.control / "release").touch()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive() and self.replies[0][0] == 200


@pytest.fixture(scope="module")
def full_server(tmp_path_factory):
    """A gated server that admits one POST at a time: a second one gets 429."""
    folder = tmp_path_factory.mktemp("full")
    with fake_server(folder, gated=True, SEMIF_MAX_QUEUE="1") as live:
        yield live, folder / "control"


@pytest.fixture(scope="module")
def gated_server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gated")
    with fake_server(folder, gated=True) as live:
        yield live, folder / "control"


def releasing_sleep(blocker: Blocker, mode: str, sleeps: list[float]):
    """A sleep that frees the server instead of waiting: the retry then finds it free."""

    def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        blocker.release()

    async def asleep(seconds: float) -> None:
        sleep(seconds)

    return sleep if mode == "sync" else asleep


@pytest.mark.server
@pytest.mark.parametrize("mode", MODES)
def test_a_429_from_a_full_server_is_retried_after_its_retry_after(full_server, mode):
    blocker, sleeps, transport = Blocker(full_server), [], recording(mode)
    result = run(
        mode, lambda c: c.decide(row(id="mine")), url=url_of(full_server[0]), transport=transport,
        sleep=releasing_sleep(blocker, mode, sleeps), random=lambda: 0.0,
    )  # fmt: skip
    assert result["id"] == "mine"
    # The server's Retry-After (its estimated wait, at least 1 s: above the first backoff of
    # 0.25 s) is what the client slept.
    refused = transport.exchanges[0][1]
    assert sleeps == [float(refused.headers["Retry-After"])] and sleeps[0] >= 1.0
    statuses = [response.status_code for _, response, _ in transport.exchanges]
    assert statuses == [429, 200]


@pytest.fixture
def fresh_gated_server(tmp_path):
    """A gated server of its own, whose model has served nothing yet: no estimated wait, so a
    short timeout_s is never refused as it queues (it waits, then 503)."""
    with fake_server(tmp_path, gated=True) as live:
        yield live, tmp_path / "control"


@pytest.mark.server
@pytest.mark.parametrize("mode", MODES)
def test_a_503_server_busy_after_the_queue_timeout_is_retried(fresh_gated_server, mode):
    gated_server = fresh_gated_server
    blocker, sleeps, transport = Blocker(gated_server), [], recording(mode)
    body = row(id="mine", timeout_s=0.2)  # waits 0.2 s for the held model, then 503
    result = run(
        mode, lambda c: c.decide(body), url=url_of(gated_server[0]), transport=transport,
        sleep=releasing_sleep(blocker, mode, sleeps), random=lambda: 0.0,
    )  # fmt: skip
    assert result["id"] == "mine" and sleeps == [1.0]
    first = transport.exchanges[0][1]
    assert first.status_code == 503 and first.json()["error"]["code"] == "server_busy"
    assert first.headers[STATE_KEY_HEADER] == state_key(body["state"])
    assert [response.status_code for _, response, _ in transport.exchanges] == [503, 200]


def test_the_client_imports_no_torch():
    code = "import sys, semif_serve.client; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


# -- statuses on demand: httpx.MockTransport -------------------------------------------------------


def envelope(status: int, code: str, retry_after: str | None = None, **headers) -> httpx.Response:
    if retry_after is not None:
        headers["Retry-After"] = retry_after
    headers["X-Request-Id"] = f"id-{status}"
    body = {"error": {"code": code, "message": f"{code} happened"}}
    return httpx.Response(status, json=body, headers=headers)


OK = {"id": "r1", "option_ids": ["o0", "o1"], "probabilities": [0.5, 0.5]}


class Script:
    """A MockTransport handler that answers from a list (the last answer repeats) and keeps
    each request with the timeout the client gave it."""

    def __init__(self, *answers: httpx.Response | Exception):
        self.answers = list(answers)
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return answer

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self)

    def read_timeouts(self) -> list[float]:
        return [request.extensions["timeout"]["read"] for request in self.requests]


def decide_with(mode, script, fake, policy=None, draw=0.0, body=None):
    return run(
        mode, lambda c: c.decide(body or row()), transport=script.transport(),
        policy=policy or BOUNDED, **timing(fake, mode, draw),
    )  # fmt: skip


@pytest.mark.parametrize("mode", MODES)
def test_429_then_success_waits_the_retry_after(mode):
    fake, script = FakeTime(), Script(envelope(429, "busy", "2"), httpx.Response(200, json=OK))
    assert decide_with(mode, script, fake) == OK
    assert fake.sleeps == [2.0] and len(script.requests) == 2


@pytest.mark.parametrize("mode", MODES)
def test_without_retry_after_the_backoff_doubles_up_to_its_cap(mode):
    fake = FakeTime()
    script = Script(*[envelope(429, "busy")] * 5, httpx.Response(200, json=OK))
    policy = RetryPolicy(initial_backoff_s=0.25, max_backoff_s=2.0, deadline_s=100)
    assert decide_with(mode, script, fake, policy) == OK
    assert fake.sleeps == [0.25, 0.5, 1.0, 2.0, 2.0]


@pytest.mark.parametrize("mode", MODES)
def test_retry_after_is_a_floor_the_backoff_can_exceed_and_jitter_only_adds(mode):
    fake = FakeTime()
    script = Script(*[envelope(429, "busy", "1")] * 4, httpx.Response(200, json=OK))
    policy = RetryPolicy(initial_backoff_s=0.5, max_backoff_s=8, jitter=0.5, deadline_s=100)
    assert decide_with(mode, script, fake, policy, draw=0.5) == OK
    # max(Retry-After 1, 0.5 * 2**n) * (1 + 0.5 * 0.5)
    assert fake.sleeps == [1.25, 1.25, 2.5, 5.0]


def test_an_http_date_retry_after_is_read_as_seconds_from_now():
    fake = FakeTime()
    later = formatdate(time.time() + 30, usegmt=True)
    script = Script(envelope(429, "busy", later), httpx.Response(200, json=OK))
    assert decide_with("sync", script, fake, RetryPolicy(deadline_s=100)) == OK
    assert 28 <= fake.sleeps[0] <= 30


@pytest.mark.parametrize("mode", MODES)
def test_the_deadline_stops_retries_and_raises_the_last_error(mode):
    fake, script = FakeTime(), Script(envelope(429, "busy", "2"))
    with pytest.raises(ApiError) as caught:
        decide_with(mode, script, fake, RetryPolicy(deadline_s=5))
    # Tried at 0, 2 and 4 s; a wait from 4 s would end at 6 s, past the deadline.
    assert fake.sleeps == [2.0, 2.0] and len(script.requests) == 3
    assert script.read_timeouts() == [5.0, 3.0, 1.0]  # each attempt gets the time left
    assert (caught.value.status, caught.value.code) == (429, "busy")
    assert caught.value.retry_after_s == 2.0 and caught.value.request_id == "id-429"


@pytest.mark.parametrize("mode", MODES)
def test_a_wait_ending_exactly_at_the_deadline_is_not_attempted(mode):
    fake, script = FakeTime(), Script(envelope(503, "server_busy", "5"))
    with pytest.raises(ApiError):
        decide_with(mode, script, fake, RetryPolicy(deadline_s=5))
    assert fake.sleeps == [] and len(script.requests) == 1


@pytest.mark.parametrize("mode", MODES)
def test_503_server_busy_is_retried(mode):
    fake = FakeTime()
    script = Script(envelope(503, "server_busy", "1"), httpx.Response(200, json=OK))
    assert decide_with(mode, script, fake) == OK
    assert fake.sleeps == [1.0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("status", "code"),
    [
        (503, "out_of_memory"),
        (503, "model_load_failed"),
        (503, "insufficient_memory"),
        (422, "invalid_request"),
        (400, "bad_request"),
        (404, "model_not_found"),
        (408, "request_timeout"),
        (500, "scoring_failed"),
    ],
)
def test_other_errors_are_raised_at_once(mode, status, code):
    fake, script = FakeTime(), Script(envelope(status, code, "1"), httpx.Response(200, json=OK))
    with pytest.raises(ApiError) as caught:
        decide_with(mode, script, fake)
    assert (caught.value.status, caught.value.code) == (status, code)
    assert caught.value.message == f"{code} happened"
    assert caught.value.retry_after_s == 1.0  # there for a caller who decides to retry
    assert fake.sleeps == [] and len(script.requests) == 1
    assert caught.value.call == f"POST {URL}/decide"
    assert str(caught.value) == (
        f"POST {URL}/decide: {status} {code}: {code} happened (X-Request-Id: id-{status})"
    )


@pytest.mark.parametrize("mode", MODES)
def test_a_proxy_error_page_without_the_envelope_keeps_its_status_and_text(mode):
    page = httpx.Response(502, text="<html>502 Bad Gateway</html>")
    fake, script = FakeTime(), Script(page)
    with pytest.raises(ApiError) as caught:
        decide_with(mode, script, fake)
    assert (caught.value.status, caught.value.code, caught.value.request_id) == (502, None, None)
    assert caught.value.message == "<html>502 Bad Gateway</html>"
    assert len(script.requests) == 1


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b'{"error": {"code": "busy", "message": 5}}', '{"error": {"code": "busy", "message": 5}}'),
        (b'{"error": {"code": null, "message": "m"}}', '{"error": {"code": null, "message": "m"}}'),
        (b"", "(empty reply)"),
        (b" \r\n ", "(empty reply)"),
        (b"\xffBad Gateway", "\ufffdBad Gateway"),
        # the first 200 bytes: 'x' and 99 two-byte characters, the 100th cut in half
        (b"x" + "é".encode() * 150, "x" + "é" * 99 + "\ufffd"),
    ],
    ids=["message-not-text", "code-not-text", "empty", "blank", "not-utf8", "cut-at-200-bytes"],
)
def test_a_reply_that_is_not_the_envelope_is_shown_as_text(content, message):
    fake, script = FakeTime(), Script(httpx.Response(502, content=content))
    with pytest.raises(ApiError) as caught:
        decide_with("sync", script, fake)
    assert (caught.value.status, caught.value.code, caught.value.message) == (502, None, message)


@pytest.mark.parametrize("mode", MODES)
def test_a_429_from_a_proxy_is_retried_too(mode):
    fake = FakeTime()
    script = Script(httpx.Response(429, text="slow down"), httpx.Response(200, json=OK))
    assert decide_with(mode, script, fake) == OK
    assert fake.sleeps == [0.25]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("content", "detail"), [(b"not json", "not JSON"), (b"[1, 2]", "not a JSON object")]
)
def test_a_success_that_is_not_a_json_object_is_an_invalid_reply(mode, content, detail):
    reply = httpx.Response(200, content=content, headers={"X-Request-Id": "id-7"})
    fake, script = FakeTime(), Script(reply)
    with pytest.raises(InvalidReply) as caught:
        decide_with(mode, script, fake)
    error = caught.value
    assert (error.call, error.status, error.request_id) == (f"POST {URL}/decide", 200, "id-7")
    assert str(error) == f"POST {URL}/decide: 200: {detail} (X-Request-Id: id-7)"
    assert fake.sleeps == [] and len(script.requests) == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("failure", "message"),
    [
        (httpx.ConnectTimeout("slow"), "no reply within 30 s"),
        (httpx.ReadTimeout("slow"), "no reply within 30 s"),
        (httpx.WriteError("reset"), "the connection failed: WriteError"),
        (httpx.RemoteProtocolError("closed"), "the connection failed: RemoteProtocolError"),
    ],
)
def test_transport_failures_after_connecting_are_connection_failed_and_not_retried(
    mode, failure, message
):
    fake, script = FakeTime(), Script(failure, httpx.Response(200, json=OK))
    with pytest.raises(ConnectionFailed, match=message):
        decide_with(mode, script, fake)
    assert fake.sleeps == [] and len(script.requests) == 1


@pytest.mark.parametrize("mode", MODES)
def test_requests_carry_the_token_json_and_the_state_key(mode):
    script = Script(httpx.Response(200, json={"results": [], "timing": {}}))
    body = {"state": "Die Tür ist offen 🚪", "decisions": [decision("a")]}
    run(mode, lambda c: c.decide_shared(body), transport=script.transport(),
        **timing(FakeTime(), mode))  # fmt: skip
    (request,) = script.requests
    assert (request.method, request.url.path) == ("POST", "/decide/shared")
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert request.headers["Accept"] == "application/json"
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers[STATE_KEY_HEADER] == state_key(body["state"])
    sent = {**body, "timeout_s": SHARE}
    assert request.content == json.dumps(sent, ensure_ascii=False).encode("utf-8")


@pytest.mark.parametrize("mode", MODES)
def test_a_session_is_sent_in_its_header_instead_of_the_state_key(mode):
    script = Script(*[httpx.Response(200, json={"results": [], "timing": {}})] * 2)
    shared = {"state": "log v2", "decisions": [decision("a")]}

    async def both_async(client):
        await client.decide_shared(shared, session="agent-7")
        await client.decide(row(state="log v3"), session="agent-7")

    def both(client):
        client.decide_shared(shared, session="agent-7")
        client.decide(row(state="log v3"), session="agent-7")

    run(mode, both if mode == "sync" else both_async, transport=script.transport(),
        **timing(FakeTime(), mode))  # fmt: skip
    for request in script.requests:  # routed by the session: every version to one replica
        assert request.headers[SESSION_HEADER] == "agent-7"
        assert STATE_KEY_HEADER not in request.headers
    with pytest.raises(ValueError, match="X-Semif-Session: only visible ASCII"):
        run("sync", lambda c: c.decide(row(), session="two words"), transport=script.transport())
    assert len(script.requests) == 2  # a bad session is refused before sending


def test_a_get_sends_no_body_and_no_state_key():
    script = Script(httpx.Response(200, json={"models": []}))
    run("sync", lambda c: c.models(), transport=script.transport(), token=None)
    (request,) = script.requests
    assert request.content == b"" and STATE_KEY_HEADER not in request.headers
    assert "Authorization" not in request.headers
    assert request.headers["Accept"] == "application/json"


@pytest.mark.parametrize(
    "body",
    [
        row(state=[float("nan")]),
        row(timeout_s=float("nan")),  # never replaced by the server's share: refused as it is
        row(timeout_s=float("inf")),
    ],
    ids=["state-nan", "timeout-nan", "timeout-inf"],
)
def test_a_body_that_is_not_json_fails_before_sending(body):
    script = Script(httpx.Response(200, json=OK))
    with pytest.raises(ValueError):
        run("sync", lambda c: c.decide(body), transport=script.transport())
    assert script.requests == []


def test_a_closed_client_sends_nothing():
    script = Script(httpx.Response(200, json=OK))
    with Client(URL, TOKEN, transport=script.transport()) as client:
        client.health()
    with pytest.raises(RuntimeError):
        client.health()
    assert len(script.requests) == 1


BACKOFF_RULE = "backoff: need 0 <= initial_backoff_s <= max_backoff_s"


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ({"deadline_s": 0}, "deadline_s: must be a positive number, got 0"),
        ({"deadline_s": float("inf")}, "deadline_s: must be a positive number, got inf"),
        ({"deadline_s": float("nan")}, "deadline_s: must be a positive number, got nan"),
        ({"initial_backoff_s": 2, "max_backoff_s": 1}, BACKOFF_RULE),
        ({"initial_backoff_s": -0.1}, BACKOFF_RULE),
        ({"jitter": 1.5}, "jitter: must be within 0..1, got 1.5"),
        ({"jitter": -0.1}, "jitter: must be within 0..1, got -0.1"),
        ({"margin_s": -0.1}, "margin_s: must be a number >= 0, got -0.1"),
        ({"margin_s": float("inf")}, "margin_s: must be a number >= 0, got inf"),
        ({"margin_s": float("nan")}, "margin_s: must be a number >= 0, got nan"),
    ],
)
def test_a_policy_that_cannot_work_is_refused(policy, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        RetryPolicy(**policy)


@pytest.mark.parametrize(
    "policy",
    [
        {"deadline_s": 0.5},
        {"initial_backoff_s": 0},
        {"initial_backoff_s": 3, "max_backoff_s": 3},
        {"jitter": 0},
        {"jitter": 1},
        {"margin_s": 0},
    ],
)
def test_a_policy_at_the_edge_of_its_ranges_is_accepted(policy):
    accepted = RetryPolicy(**policy)
    assert {name: getattr(accepted, name) for name in policy} == policy


@pytest.mark.parametrize("mode", MODES)
def test_attempts_under_a_second_from_the_deadline_get_only_the_time_left(mode):
    # A success after three 429s: a client that kept retrying past the deadline would get it.
    fake = FakeTime()
    script = Script(*[envelope(429, "busy")] * 3, httpx.Response(200, json=OK))
    with pytest.raises(ApiError):
        decide_with(mode, script, fake, RetryPolicy(deadline_s=1, initial_backoff_s=0.25))
    # Tried at 0, 0.25 and 0.75 s; the next wait (1 s) would end past the deadline.
    assert fake.sleeps == [0.25, 0.5]
    assert script.read_timeouts() == [1.0, 0.75, 0.25]


def test_past_the_deadline_the_time_left_is_zero():
    fake = FakeTime()
    attempts = Attempts(RetryPolicy(deadline_s=5), fake, lambda: 0.0)
    fake.now = 7.0
    assert attempts.timeout_s() == 0.0
    assert attempts.wait_before_retry(ApiError("c", 429, "busy", "m", None)) is None


NOW = 1_700_000_000.0  # a fixed wall clock for HTTP-dates


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        ("3", 3.0),
        (" 120 ", 120.0),
        ("0", 0.0),
        (formatdate(NOW + 30, usegmt=True), 30.0),
        (formatdate(NOW - 30, usegmt=True), 0.0),  # a date in the past: come back now
        ("Tue, 14 Nov 2023 22:13:20", None),  # no zone: not an HTTP-date
        ("1.5", None),
        ("-1", None),
        ("٣", None),  # a digit, but not ASCII
        ("soon", None),
        ("", None),
    ],
)
def test_retry_after_is_seconds_or_an_http_date(value, seconds):
    assert parse_retry_after(value, lambda: NOW) == seconds


# -- the deadline, end to end ---------------------------------------------------------------------


def sent_timeouts(script: Script) -> list:
    return [json.loads(request.content).get("timeout_s") for request in script.requests]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("route", ["decide", "decide_shared"])
def test_each_body_carries_the_time_left_less_the_margin_as_timeout_s(mode, route):
    fake = FakeTime()
    script = Script(envelope(429, "busy", "2"), envelope(503, "server_busy", "3"),
                    httpx.Response(200, json=OK))  # fmt: skip
    shared = {"state": STATE, "decisions": [decision("a")]}
    run(mode, lambda c: c.decide(row()) if route == "decide" else c.decide_shared(shared),
        transport=script.transport(), **timing(fake, mode))  # fmt: skip
    # Sent at 0, 2 and 5 s of a 30 s deadline: the server gives up queueing 1 s before it.
    assert sent_timeouts(script) == [29.0, 27.0, 24.0]
    assert script.read_timeouts() == [30.0, 28.0, 25.0]  # the client waits for all of it


@pytest.mark.parametrize(
    ("policy", "first"),
    [
        (RetryPolicy(deadline_s=5), 4.5),  # a margin of at most a tenth of the deadline
        (RetryPolicy(deadline_s=100, margin_s=2.5), 97.5),
        (RetryPolicy(deadline_s=5, margin_s=0), 5.0),
        (RetryPolicy(deadline_s=200_000), MAX_SERVER_TIMEOUT_S),  # the most the server takes
    ],
    ids=["tenth", "margin_s", "no-margin", "a-day"],
)
def test_the_server_gets_the_time_left_less_the_margin_and_at_most_a_day(policy, first):
    fake, script = FakeTime(), Script(httpx.Response(200, json=OK))
    decide_with("sync", script, fake, policy)
    assert sent_timeouts(script) == [first]


def test_the_client_caps_timeout_s_where_the_server_does():
    assert MAX_SERVER_TIMEOUT_S == MAX_TIMEOUT_S


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("asked", "sent"),
    [(5, 5), (28.5, 28.5), (100, SHARE), (None, SHARE)],
    ids=["smaller", "smaller-float", "larger", "null"],
)
def test_a_timeout_s_of_the_callers_own_is_kept_when_smaller(mode, asked, sent):
    fake, script = FakeTime(), Script(httpx.Response(200, json=OK))
    decide_with(mode, script, fake, body=row(timeout_s=asked))
    assert sent_timeouts(script) == [sent]


@pytest.mark.parametrize(
    ("asked", "sent"),
    [
        (None, 29.0),
        (5, 5),
        (29, 29),  # equal: the caller's own, an int
        (29.5, 29.0),
        (10**400, 29.0),  # compared exactly, never through a float
        (0, 0),  # the server's 422 names these: they are the caller's to fix
        (-1.5, -1.5),
        ("soon", "soon"),
        (True, True),
        ([5], [5]),
    ],
)
def test_body_timeout_s_keeps_what_the_caller_asked_unless_it_is_a_larger_number(asked, sent):
    kept = body_timeout_s(asked, 29.0)
    assert kept == sent and type(kept) is type(sent)


def test_a_body_of_another_route_gets_no_timeout_s():
    # The client sends no other body today; one for /v1/models would be refused with timeout_s.
    call = prepare("PUT", "/v1/models/extra", {"source": "builtin:smollm2-135m"})
    assert json.loads(attempt_body(call, "PUT", 5.0)) == {"source": "builtin:smollm2-135m"}
    assert attempt_body(prepare("GET", "/health"), "GET", 5.0) is None
    with pytest.raises(ConnectionFailed, match="^GET: not sent: too little time left"):
        attempt_body(prepare("GET", "/health"), "GET", 0.0)


@pytest.mark.parametrize("mode", MODES)
def test_too_little_time_left_for_the_server_fails_without_sending(mode):
    # The 1 s wait for a retry lasted 4.5 s: at 4.5 s of 5, the server's share (5 - 4.5 - 0.5)
    # is gone, so the client gives up at once instead of sending a call it cannot wait for.
    fake = FakeTime(oversleep=3.5)
    script = Script(envelope(429, "busy", "1"), httpx.Response(200, json=OK))
    with pytest.raises(ConnectionFailed) as caught:
        decide_with(mode, script, fake, RetryPolicy(deadline_s=5))
    assert (
        str(caught.value)
        == f"POST {URL}/decide: not sent: too little time left before the deadline"
    )
    assert fake.sleeps == [1.0] and len(script.requests) == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_get_is_not_sent_once_the_deadline_has_passed(mode):
    fake = FakeTime(oversleep=4.0)  # the 1 s wait ends exactly at the 5 s deadline
    script = Script(envelope(429, "busy", "1"), httpx.Response(200, json={"models": []}))
    with pytest.raises(ConnectionFailed, match="not sent"):
        run(mode, lambda c: c.models(), transport=script.transport(),
            policy=RetryPolicy(deadline_s=5), **timing(fake, mode))  # fmt: skip
    assert len(script.requests) == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_refused_connection_is_retried_with_the_backoff(mode):
    fake = FakeTime()
    script = Script(httpx.ConnectError("refused"), httpx.ConnectError("refused"),
                    envelope(429, "busy"), httpx.Response(200, json=OK))  # fmt: skip
    assert decide_with(mode, script, fake) == OK
    assert fake.sleeps == [0.25, 0.5, 1.0]  # one backoff for refusals and 429s alike
    assert sent_timeouts(script) == [29.0, 28.75, 28.25, 27.25]


@pytest.mark.parametrize("mode", MODES)
def test_refused_connections_are_retried_only_within_the_deadline(mode):
    fake, script = FakeTime(), Script(httpx.ConnectError("refused"))
    with pytest.raises(ConnectionFailed) as caught:
        decide_with(mode, script, fake, RetryPolicy(deadline_s=5))
    assert str(caught.value) == f"POST {URL}/decide: cannot reach the server: refused"
    # Tried at 0, 0.25, 0.75, 1.75 and 3.75 s; a 4 s wait would leave the server no share.
    assert fake.sleeps == [0.25, 0.5, 1.0, 2.0]
    assert sent_timeouts(script) == [4.5, 4.25, 3.75, 2.75, 0.75]


@pytest.mark.parametrize("mode", MODES)
def test_a_retry_is_attempted_only_while_the_server_would_get_a_share(mode):
    # Retry-After 9 from 0 s ends at 9 s, before the 10 s deadline but at its 1 s margin.
    fake, script = FakeTime(), Script(envelope(429, "busy", "9"), httpx.Response(200, json=OK))
    with pytest.raises(ApiError):
        decide_with(mode, script, fake, RetryPolicy(deadline_s=10))
    assert fake.sleeps == [] and len(script.requests) == 1


def test_attempts_share_out_the_deadline():
    fake = FakeTime()
    policy = RetryPolicy(deadline_s=30, margin_s=2)
    timed, untimed = Attempts(policy, fake, lambda: 0.0, True), Attempts(policy, fake, lambda: 0.0)
    fake.now = 3.0
    assert (timed.timeout_s(), timed.server_timeout_s()) == (27.0, 25.0)
    assert (untimed.timeout_s(), untimed.server_timeout_s()) == (27.0, 27.0)
    assert timed.wait_before_reconnect() == 0.25 and untimed.wait_before_reconnect() == 0.25
    fake.now = 27.5  # a 0.5 s wait (the second) would end at the timed call's last start, 28 s
    assert timed.wait_before_reconnect() is None and untimed.wait_before_reconnect() == 0.5
    assert RetryPolicy(deadline_s=10, margin_s=2).server_margin_s() == 1.0
    assert RetryPolicy(deadline_s=30, margin_s=2).server_margin_s() == 2.0


class SlowServer:
    """A raw socket server on 127.0.0.1 that is slow on purpose, one connection at a time:
    `reply`: reads the request, then sends a reply one byte every 20 ms (each read of the client
    gets its byte long before a read timeout); `read`: takes the body 4 KiB every 20 ms, until
    `hurry` is set (the body the client had buffered then arrives at once). `closed` is set once
    the client has closed the connection."""

    PAUSE_S = 0.02

    def __init__(self, slow: str):
        self.slow = slow
        self.closed = threading.Event()
        self.hurry = threading.Event()
        self.stopping = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> SlowServer:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.listener.close()
        self.thread.join(WAIT_S)

    def _serve(self) -> None:
        connection, _ = self.listener.accept()
        with connection:
            connection.settimeout(WAIT_S)
            try:
                if self.slow == "read":
                    self._read_slowly(connection)
                else:
                    self._read_request(connection)
                    self._reply_slowly(connection)
            except OSError:
                pass
        self.closed.set()

    def _read_request(self, connection: socket.socket) -> None:
        data = b""
        while b"\r\n\r\n" not in data:
            data += connection.recv(65536)
        head, _, body = data.partition(b"\r\n\r\n")
        length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
        while len(body) < length:
            body += connection.recv(65536)

    def _reply_slowly(self, connection: socket.socket) -> None:
        reply = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n" + b" " * 100_000
        for byte in reply:
            if self.stopping.wait(self.PAUSE_S):
                return
            connection.sendall(bytes([byte]))

    def _read_slowly(self, connection: socket.socket) -> None:
        while self.hurry.is_set() or not self.stopping.wait(self.PAUSE_S):
            if not connection.recv(65536):
                return


SMALL_SEND_BUFFER = [(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)]  # no autotuning to MiBs


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("slow", ["reply", "read"])
def test_an_attempt_ends_by_the_deadline_however_slowly_the_server_goes(mode, slow):
    # httpx alone gives each socket operation the whole timeout, and each one here ends well
    # within it: the slow reply (100 kB at a byte per 20 ms) would hold the call for half an
    # hour, the slow read of a 2 MB body (4 KiB per 20 ms, through small socket buffers) a
    # Client for 10 s (httpx's async transport already bounds a whole write by its timeout).
    deadline_s, outcome = 0.5, []
    body, transport = row(), None
    if slow == "read":
        body = row(state="x" * 2_000_000)
        transport = (DeadlineTransport(SMALL_SEND_BUFFER) if mode == "sync"
                     else httpx.AsyncHTTPTransport(socket_options=SMALL_SEND_BUFFER))  # fmt: skip

    def call():
        try:
            run(mode, lambda c: c.decide(body), url=server.url, policy=RetryPolicy(deadline_s),
                transport=transport)  # fmt: skip
        except ConnectionFailed as error:
            outcome.append(error)

    with SlowServer(slow) as server:
        caller = threading.Thread(target=call)
        started = time.monotonic()
        caller.start()
        caller.join(5)  # the watchdog
        assert not caller.is_alive(), "the attempt outlived its deadline by seconds"
        assert time.monotonic() - started >= deadline_s
        (error,) = outcome
        shown = re.escape(f"POST {server.url}/decide: no reply within ")
        assert re.fullmatch(shown + r"0\.[45]\d* s \(the call's deadline\)", str(error))
        server.hurry.set()
        assert server.closed.wait(WAIT_S)  # the client closed the connection: the server sees it


@pytest.mark.server
def test_the_default_transport_is_the_deadline_one_and_keeps_one_connection(server):
    with Client(url_of(server), TOKEN, policy=BOUNDED) as client:
        assert isinstance(client._http._transport, DeadlineTransport)
        client.health()
        client.decide(row())
        client.models()
        assert len(client._http._transport._pool.connections) == 1
