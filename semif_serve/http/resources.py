"""The three endpoints. Each reads its body within the limit, asks the service, sends JSON."""

from __future__ import annotations

import json

import falcon

from semif_serve.errors import ScoringFailed
from semif_serve.http.body import read_json_object
from semif_serve.metrics import CONTENT_TYPE, Metrics
from semif_serve.runtime.service import DecisionService, Outcome


def send_json(resp: falcon.Response, body: dict) -> None:
    """Serialise here, inside the error handling: a reply that cannot render is a 500 (C3)."""
    try:
        resp.text = json.dumps(body, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ScoringFailed(f"the response could not be rendered as JSON: {error}") from None
    resp.content_type = falcon.MEDIA_JSON


class Health:
    def __init__(self, service: DecisionService):
        self._service = service

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        send_json(resp, self._service.health())


class _Scoring:
    admitted = True  # counts toward SEMIF_MAX_QUEUE (see middleware.Admission)

    def __init__(self, service: DecisionService, max_body_bytes: int):
        self._service = service
        self._max_body_bytes = max_body_bytes

    def _reply(self, req: falcon.Request, resp: falcon.Response, outcome: Outcome) -> None:
        req.context.rows = outcome.rows
        send_json(resp, outcome.body)

    def _body(self, req: falcon.Request) -> dict:
        return read_json_object(req.env, self._max_body_bytes)


class Decide(_Scoring):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        self._reply(req, resp, self._service.decide(self._body(req)))


class DecideShared(_Scoring):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        self._reply(req, resp, self._service.decide_shared(self._body(req)))


class MetricsPage:
    """GET /metrics: Prometheus text format, no token (like /health)."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.data = self._metrics.render()
        resp.content_type = CONTENT_TYPE
