"""`Client`: semif-serve over HTTP, blocking, with one httpx connection pool per client."""

from __future__ import annotations

import time
from collections.abc import Callable
from random import random as uniform
from typing import Any, cast

import httpx

from semif_serve.client.errors import ApiError
from semif_serve.client.retry import Attempts, RetryPolicy
from semif_serve.client.types import (
    DecideReply,
    DecideRequest,
    Health,
    ModelList,
    SharedReply,
    SharedRequest,
)
from semif_serve.client.wire import Call, describe, no_reply, prepare, reply_body, session_headers

DEFAULT_URL = "http://127.0.0.1:8471"


class Client:
    """`with Client(url, token) as client: client.decide({...})`.

    Retries 429 and 503 `server_busy` within `policy.deadline_s` (semif_serve/client/retry.py);
    raises `SemifError` subclasses (semif_serve/client/errors.py). `transport`, `clock`, `sleep`
    and `random` are for tests: an httpx transport, a monotonic clock, a sleep and U[0, 1).
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

    @property
    def base_url(self) -> str:
        return str(self._http.base_url).rstrip("/")

    def health(self) -> Health:
        return cast(Health, self._call(prepare("GET", "/health")))

    def models(self) -> ModelList:
        return cast(ModelList, self._call(prepare("GET", "/v1/models")))

    def decide(self, request: DecideRequest) -> DecideReply:
        return cast(DecideReply, self._call(prepare("POST", "/decide", dict(request))))

    def decide_shared(self, request: SharedRequest) -> SharedReply:
        return cast(SharedReply, self._call(prepare("POST", "/decide/shared", dict(request))))

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, call: Call) -> dict[str, Any]:
        name = describe(call, self.base_url)
        attempts = Attempts(self.policy, self._clock, self._random)
        while True:
            timeout_s = attempts.timeout_s()
            try:
                response = self._http.request(
                    call.method,
                    call.path,
                    content=call.content,
                    headers=call.headers,
                    timeout=timeout_s,
                )
            except httpx.RequestError as error:
                raise no_reply(name, error, timeout_s) from error
            try:
                return reply_body(name, response)
            except ApiError as error:
                wait_s = attempts.wait_before_retry(error)
                if wait_s is None:
                    raise
            self._sleep(wait_s)
