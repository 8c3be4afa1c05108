"""The endpoints. Each reads its body within the limit, asks the service, sends JSON.

A scoring request whose body holds a valid `state` gets that state's key in
`req.context.state_key`, whatever happens next; `middleware.RequestLog` answers with it. The
worker's `semif.client_gone` check (environ) goes to the service, which drops a request whose
client has left before scoring it.
"""

from __future__ import annotations

import json

import falcon

from semif_serve.errors import ScoringFailed
from semif_serve.http.body import read_json_object
from semif_serve.metrics import CONTENT_TYPE, Metrics
from semif_serve.runtime.service import DecisionService, Outcome
from semif_serve.scoring.rows import InvalidRow, parse_state
from semif_serve.sockets import CLIENT_GONE_KEY
from semif_serve.state_key import state_key


def send_json(resp: falcon.Response, body: dict) -> None:
    """Serialise and encode here, inside the error handling: a reply that cannot render (not
    JSON, or text UTF-8 cannot encode) is a 500 (C3), and the access log and /metrics say so."""
    try:
        resp.data = json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as error:  # UnicodeEncodeError is a ValueError
        raise ScoringFailed(f"the response could not be rendered as JSON: {error}") from None
    resp.content_type = falcon.MEDIA_JSON


class Health:
    """GET and HEAD /health, no token; load balancers probe with either."""

    def __init__(self, service: DecisionService):
        self._service = service

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        send_json(resp, self._service.health())

    on_head = on_get  # Falcon answers a HEAD with the GET's status and headers, no body


class _Scoring:
    admitted = True  # counts toward SEMIF_MAX_QUEUE (see middleware.Admission)

    def __init__(self, service: DecisionService, max_body_bytes: int):
        self._service = service
        self._max_body_bytes = max_body_bytes

    def _reply(self, req: falcon.Request, resp: falcon.Response, outcome: Outcome) -> None:
        req.context.rows = outcome.rows
        send_json(resp, outcome.body)

    def _body(self, req: falcon.Request) -> dict:
        body = read_json_object(req.env, self._max_body_bytes)
        req.context.state_key = accepted_state_key(body)
        return body


def accepted_state_key(body: dict) -> str | None:
    """The key of the body's `state`; None when it has none the service accepts (missing, blank,
    not finite, nested too deeply: the service's 422 then says why). A key the caller sent in
    X-Semif-State-Key is never read: routers hash on it, the reply always carries the true one."""
    try:
        return state_key(parse_state(body["state"]))
    except (KeyError, InvalidRow):
        return None


class Decide(_Scoring):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = self._body(req)
        self._reply(req, resp, self._service.decide(body, req.env.get(CLIENT_GONE_KEY)))


class DecideShared(_Scoring):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        body = self._body(req)
        self._reply(req, resp, self._service.decide_shared(body, req.env.get(CLIENT_GONE_KEY)))


class MetricsPage:
    """GET and HEAD /metrics: Prometheus text format, no token (like /health)."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.data = self._metrics.render()
        resp.content_type = CONTENT_TYPE

    on_head = on_get  # as Health's
