"""`Client`: semif-serve over HTTP, blocking, with one httpx connection pool per client."""

from __future__ import annotations

import time
from collections.abc import Callable
from random import random as uniform
from typing import Any, cast

import httpx

from semif_serve.client.errors import ApiError
from semif_serve.client.retry import Attempts, RetryPolicy
from semif_serve.client.transport import DeadlineTransport, attempt_ends_in
from semif_serve.client.types import (
    DecideReply,
    DecideRequest,
    Health,
    ModelList,
    SharedReply,
    SharedRequest,
)
from semif_serve.client.wire import (
    Call,
    attempt_body,
    describe,
    no_reply,
    prepare,
    reply_body,
    session_headers,
    timed,
)

DEFAULT_URL = "http://127.0.0.1:8471"


class Client:
    """`with Client(url, token) as client: client.decide({...})`.

    Retries 429, 503 `server_busy` and refused connections within `policy.deadline_s`, and
    tells the server its share of that deadline as each body's `timeout_s`
    (semif_serve/client/retry.py); no attempt outlasts the deadline (transport.py); raises
    `SemifError` subclasses (semif_serve/client/errors.py). `transport`, `clock`, `sleep` and
    `random` are for tests: an httpx transport (it replaces the one that ends every socket
    operation by the deadline), a monotonic clock, a sleep and U[0, 1).
    """

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        policy: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        random: Callable[[], float] = uniform,
    ):
        self.policy = policy or RetryPolicy()
        self._clock, self._sleep, self._random = clock, sleep, random
        self._http = httpx.Client(
            base_url=base_url, headers=session_headers(token), transport=transport
        )
        if transport is None:
            # httpx's default transport, on connections that end by each attempt's deadline.
            # Swapped in after the fact: passing it as `transport` would make httpx ignore the
            # proxy variables (HTTP_PROXY, NO_PROXY, ...) that it honours by default.
            self._http._transport = DeadlineTransport()

    @property
    def base_url(self) -> str:
        return str(self._http.base_url).rstrip("/")

    def health(self) -> Health:
        return cast(Health, self._call(prepare("GET", "/health")))

    def models(self) -> ModelList:
        return cast(ModelList, self._call(prepare("GET", "/v1/models")))

    def decide(self, request: DecideRequest, session: str | None = None) -> DecideReply:
        """`session`: the caller's (X-Semif-Session), for a state that grows between calls."""
        call = prepare("POST", "/decide", dict(request), session)
        return cast(DecideReply, self._call(call))

    def decide_shared(self, request: SharedRequest, session: str | None = None) -> SharedReply:
        call = prepare("POST", "/decide/shared", dict(request), session)
        return cast(SharedReply, self._call(call))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, call: Call) -> dict[str, Any]:
        name = describe(call, self.base_url)
        attempts = Attempts(self.policy, self._clock, self._random, timed(call))
        while True:
            timeout_s = attempts.timeout_s()
            content = attempt_body(call, name, attempts.server_timeout_s())
            try:
                with attempt_ends_in(timeout_s):
                    response = self._http.request(
                        call.method,
                        call.path,
                        content=content,
                        headers=call.headers,
                        timeout=timeout_s,
                    )
            except httpx.ConnectError as error:  # refused: nothing reached the server
                wait_s = attempts.wait_before_reconnect()
                if wait_s is None:
                    raise no_reply(name, error, timeout_s) from error
            except httpx.RequestError as error:
                raise no_reply(name, error, timeout_s) from error
            else:
                try:
                    return reply_body(name, response)
                except ApiError as error:
                    wait_s = attempts.wait_before_retry(error)
                    if wait_s is None:
                        raise
            self._sleep(wait_s)
