"""Requests out and replies in, with no I/O: what `Client` and `AsyncClient` share.

`prepare` turns a method, path and body into a `Call` (the body, the headers, the state key);
`attempt_body` encodes one attempt's body with the server's share of the deadline as `timeout_s`;
`describe` names a call in messages; `reply_body` turns an httpx response into the JSON object or
the matching exception; `no_reply` turns a transport failure into `ConnectionFailed`.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from semif_serve.client.errors import ApiError, ConnectionFailed, InvalidReply
from semif_serve.client.retry import body_timeout_s, parse_retry_after
from semif_serve.session import SESSION_HEADER, parse_session
from semif_serve.state_key import STATE_KEY_HEADER, state_key

REQUEST_ID_HEADER = "X-Request-Id"  # the server's id for the request (http/middleware.py)
SHOWN_BYTES = 200  # of a reply that is not the envelope
TIMED_PATHS = frozenset({"/decide", "/decide/shared"})  # bodies that take `timeout_s`


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)


def timed(call: Call) -> bool:
    """Whether the call's body tells the server its share of the deadline (`timeout_s`)."""
    return call.body is not None and call.path in TIMED_PATHS


def session_headers(token: str | None) -> dict[str, str]:
    """Headers every request of one client carries."""
    headers = {"Accept": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def prepare(
    method: str, path: str, body: dict[str, Any] | None = None, session: str | None = None
) -> Call:
    """The call for `body` (sent as JSON). With a `session` it sends X-Semif-Session (routers
    hash on it: every version of a growing state reaches one replica), else a body with a
    `state` sends its X-Semif-State-Key. A body that is not JSON (NaN, a set) or a bad session
    raises ValueError or TypeError here, before sending."""
    if body is None:
        return Call(method, path)
    to_json(body)
    headers = {"Content-Type": "application/json"}
    if session is not None:
        headers[SESSION_HEADER] = parse_session(session)
    elif "state" in body:
        headers[STATE_KEY_HEADER] = state_key(body["state"])
    return Call(method, path, dict(body), headers)


def to_json(body: dict[str, Any]) -> bytes:
    return json.dumps(body, ensure_ascii=False, allow_nan=False).encode("utf-8")


def attempt_body(call: Call, name: str, server_timeout_s: float) -> bytes | None:
    """The next attempt's body, a timed one with `timeout_s` = the server's share of the time
    left (`Attempts.server_timeout_s`), unless the caller asked for less; ConnectionFailed,
    without sending anything, when that share is gone (`name` is the call's `describe`)."""
    if server_timeout_s <= 0:
        raise ConnectionFailed(f"{name}: not sent: too little time left before the deadline")
    if call.body is None:
        return None
    if not timed(call):
        return to_json(call.body)
    asked = call.body.get("timeout_s")
    return to_json({**call.body, "timeout_s": body_timeout_s(asked, server_timeout_s)})


def describe(call: Call, base_url: str) -> str:
    """How messages name a call: `POST http://127.0.0.1:8471/decide`."""
    return f"{call.method} {base_url}{call.path}"


def reply_body(name: str, response: httpx.Response) -> dict[str, Any]:
    """The reply's JSON object; ApiError for an error status, InvalidReply for a success
    without a JSON object. `name` is the call's `describe`."""
    request_id = response.headers.get(REQUEST_ID_HEADER)
    if response.is_success:
        try:
            body = json.loads(response.content)
        except ValueError:
            raise InvalidReply(name, response.status_code, request_id, "not JSON") from None
        if not isinstance(body, dict):
            raise InvalidReply(name, response.status_code, request_id, "not a JSON object")
        return body
    code, message = _envelope(response.content)
    retry_after = parse_retry_after(response.headers.get("Retry-After"), time.time)
    raise ApiError(name, response.status_code, code, message, request_id, retry_after)


def _envelope(content: bytes) -> tuple[str | None, str]:
    """(code, message) of an error reply; (None, its start) when it is not the envelope."""
    try:
        error = json.loads(content)["error"]
        code, message = error["code"], error["message"]
        if isinstance(code, str) and isinstance(message, str):
            return code, message
    except (ValueError, KeyError, TypeError):
        pass
    return None, content[:SHOWN_BYTES].decode("utf-8", "replace").strip() or "(empty reply)"


def no_reply(name: str, error: httpx.RequestError, timeout_s: float) -> ConnectionFailed:
    """The ConnectionFailed for a request that got no usable reply: unreachable, broken, out of
    time."""
    if isinstance(error, httpx.TimeoutException):
        return out_of_time(name, timeout_s)
    if isinstance(error, httpx.ConnectError):
        return ConnectionFailed(f"{name}: cannot reach the server: {error}")
    return ConnectionFailed(f"{name}: the connection failed: {type(error).__name__}: {error}")


def out_of_time(name: str, timeout_s: float) -> ConnectionFailed:
    """The ConnectionFailed for an attempt that ran out of its `timeout_s`, the time left."""
    return ConnectionFailed(f"{name}: no reply within {timeout_s:g} s (the call's deadline)")
