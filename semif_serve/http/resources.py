"""The endpoints. Each reads its body within the limit, asks the service, sends JSON.

A scoring request whose body holds a valid `state` gets that state's key in
`req.context.state_key`, whatever happens next; `middleware.RequestLog` answers with it. The
worker's `semif.client_gone` check (environ) goes to the service, which drops a request whose
client has left before scoring it.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

import falcon

from semif_serve.errors import ScoringFailed
from semif_serve.http.body import read_json_object
from semif_serve.http.environ import CLIENT_GONE_KEY, DRAINING_KEY
from semif_serve.http.metrics import CONTENT_TYPE, Metrics
from semif_serve.runtime.service import DecisionService, Outcome
from semif_serve.scoring.rows import InvalidRow, parse_state
from semif_serve.session import SESSION_HEADER, parse_session
from semif_serve.state_key import state_key

log = logging.getLogger(__name__)
NON_FINITE_SHOWN = 4  # how many places a non-finite reply's message names


def send_json(resp: falcon.Response, body: dict) -> None:
    """Serialise and encode here, inside the error handling: a reply that cannot render (not
    JSON, or text UTF-8 cannot encode) is a 500 (C3), and the access log and /metrics say so.
    A NaN or an infinity (a model whose weights are corrupt, for some inputs or all) is said to
    be one: 500 `scoring_failed`, never a number JSON cannot carry."""
    try:
        resp.data = json.dumps(body, ensure_ascii=False, allow_nan=False).encode()
    except (TypeError, ValueError) as error:  # UnicodeEncodeError is a ValueError
        places = non_finite_paths(body)
        if places:
            log.error("the model produced non-finite scores at %s: replied 500", ", ".join(places))
            raise ScoringFailed(non_finite_message(places)) from None
        raise ScoringFailed(f"the response could not be rendered as JSON: {error}") from None
    resp.content_type = falcon.MEDIA_JSON


def non_finite_paths(value: Any, path: str = "") -> list[str]:
    """Where `value` (a reply: dicts, lists, numbers) holds a NaN or an infinity, e.g.
    `results[1].probabilities[0]`, in document order."""
    if isinstance(value, float):
        return [] if math.isfinite(value) else [path or "the reply"]
    if isinstance(value, dict):
        items = ((f"{path}.{key}" if path else str(key), item) for key, item in value.items())
    elif isinstance(value, (list, tuple)):
        items = ((f"{path}[{index}]", item) for index, item in enumerate(value))
    else:
        return []
    return [place for inner, item in items for place in non_finite_paths(item, inner)]


def non_finite_message(places: list[str]) -> str:
    shown = ", ".join(places[:NON_FINITE_SHOWN])
    more = f" and {len(places) - NON_FINITE_SHOWN} more" if len(places) > NON_FINITE_SHOWN else ""
    return (
        f"the model produced non-finite scores (NaN or infinity at {shown}{more}); its weights "
        "may be corrupt"
    )


PUBLIC_HEALTH_KEYS = (
    "status",
    "reason",  # only when unavailable
    "semif_commit",
    "model",
    "vram_cap_gib",
    "max_tokens",
    "max_decisions",
    "workloads",
)
PUBLIC_MODEL_KEYS = ("revision", "dtype", "device")  # and its id; never its source


def public_health(health: dict[str, Any], model_id: str) -> dict[str, Any]:
    """What /health shows anyone: readiness, the limits and workloads a caller needs, and the
    default model by id, with its revision, dtype and device. Never a path: the model's
    `source` (a local folder's, for a local model) and anything else are left out, by listing
    what goes in; GET /v1/models, which needs a token, shows each model's source."""
    model = health["model"]
    shown = {"id": model_id, **{key: model[key] for key in PUBLIC_MODEL_KEYS if key in model}}
    return {
        key: shown if key == "model" else health[key] for key in PUBLIC_HEALTH_KEYS if key in health
    }


class Health:
    """GET and HEAD /health, no token; load balancers probe with either (`public_health`): 200
    while the default model serves or can load on demand, 503 while it cannot (`reason`:
    `model_load_failed`) and once the server has begun to shut down (`draining`: the worker
    answers its open connections' last requests, accepting no new ones)."""

    def __init__(self, service: DecisionService):
        self._service = service

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        service = self._service
        health = service.health()
        if req.env.get(DRAINING_KEY):
            health.update(status="unavailable", reason="draining")
        health = public_health(health, service.runtime.default_id)
        if health["status"] != "ok":
            resp.status = falcon.HTTP_503
        send_json(resp, health)

    on_head = on_get  # Falcon answers a HEAD with the GET's status and headers, no body


class _Scoring:
    admission = "scoring"  # counts toward SEMIF_MAX_QUEUE (see middleware.Admission)

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


def accepted_state_key(body: dict, empty_state: bool = False) -> str | None:
    """The key of the body's `state`; None when it has none the service accepts (missing, blank
    unless `empty_state`, not finite, nested too deeply: the service's 422 then says why). A key
    the caller sent in X-Semif-State-Key is never read: routers hash on it, the reply always
    carries the true one."""
    try:
        return state_key(parse_state(body["state"], empty_state))
    except (KeyError, InvalidRow):
        return None


# The read timeout the OpenAI SDK announces on every request (seconds, e.g. "600.0"): the
# longest its client waits for the reply, so the request waits no longer (and is refused at
# once when its estimated wait is longer). The TypeSafe SDK announces none.
PATIENCE_HEADER = "x-stainless-read-timeout"
PATIENCE = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?")


def patience_of(req: falcon.Request) -> float | None:
    """The client's announced timeout in seconds; None when absent, zero, or not a plain
    decimal number (the header is advisory: a value no SDK sends is ignored, never refused)."""
    value = (req.get_header(PATIENCE_HEADER) or "").strip()
    if not PATIENCE.fullmatch(value):
        return None
    return float(value) or None


def session_of(req: falcon.Request) -> str | None:
    """The session the caller named in X-Semif-Session (None: none); a bad one is a 422."""
    return parse_session(req.get_header(SESSION_HEADER))


class Decide(_Scoring):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        session = session_of(req)
        body = self._body(req)
        gone = req.env.get(CLIENT_GONE_KEY)
        outcome = self._service.decide(body, gone, session, patience_of(req))
        self._reply(req, resp, outcome)


class DecideShared(_Scoring):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        session = session_of(req)
        body = self._body(req)
        gone = req.env.get(CLIENT_GONE_KEY)
        outcome = self._service.decide_shared(body, gone, session, patience_s=patience_of(req))
        self._reply(req, resp, outcome)


class MetricsPage:
    """GET and HEAD /metrics: Prometheus text format, no token (like /health)."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        resp.data = self._metrics.render()
        resp.content_type = CONTENT_TYPE

    on_head = on_get  # as Health's
