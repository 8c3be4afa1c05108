"""`AsyncClient`: `Client` for asyncio, the same calls, retries and errors, awaited; each attempt
runs under `asyncio.timeout` of the time left, so none outlasts the call's deadline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from random import random as uniform
from typing import Any, cast

import httpx

from semif_serve.client.errors import ApiError
from semif_serve.client.retry import Attempts, RetryPolicy
from semif_serve.client.sync import DEFAULT_URL
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
    out_of_time,
    prepare,
    reply_body,
    session_headers,
    timed,
)


class AsyncClient:
    """`async with AsyncClient(url, token) as client: await client.decide({...})`; see `Client`.
    `sleep` is awaited (asyncio.sleep by default)."""

    def __init__(
        self,
        base_url: str = DEFAULT_URL,
        token: str | None = None,
        *,
        policy: RetryPolicy | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        random: Callable[[], float] = uniform,
    ):
        self.policy = policy or RetryPolicy()
        self._clock, self._sleep, self._random = clock, sleep, random
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=session_headers(token), transport=transport
        )

    @property
    def base_url(self) -> str:
        return str(self._http.base_url).rstrip("/")

    async def health(self) -> Health:
        return cast(Health, await self._call(prepare("GET", "/health")))

    async def models(self) -> ModelList:
        return cast(ModelList, await self._call(prepare("GET", "/v1/models")))

    async def decide(self, request: DecideRequest, session: str | None = None) -> DecideReply:
        """`session`: the caller's (X-Semif-Session), for a state that grows between calls."""
        call = prepare("POST", "/decide", dict(request), session)
        return cast(DecideReply, await self._call(call))

    async def decide_shared(
        self, request: SharedRequest, session: str | None = None
    ) -> SharedReply:
        call = prepare("POST", "/decide/shared", dict(request), session)
        return cast(SharedReply, await self._call(call))

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, call: Call) -> dict[str, Any]:
        name = describe(call, self.base_url)
        attempts = Attempts(self.policy, self._clock, self._random, timed(call))
        while True:
            timeout_s = attempts.timeout_s()
            content = attempt_body(call, name, attempts.server_timeout_s())
            try:
                async with asyncio.timeout(timeout_s):
                    response = await self._http.request(
                        call.method,
                        call.path,
                        content=content,
                        headers=call.headers,
                        timeout=timeout_s,
                    )
            except TimeoutError as error:  # asyncio.timeout's: the whole attempt ran out
                raise out_of_time(name, timeout_s) from error
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
            await self._sleep(wait_s)
