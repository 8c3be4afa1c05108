"""Cross-cutting request work: request ids, the JSON access log and the requests in progress,
bearer auth, admission."""

from __future__ import annotations

import hmac
import json
import logging
import re
import threading
import uuid
from time import perf_counter

import falcon

from semif_serve.errors import Unauthorized
from semif_serve.http.metrics import Metrics
from semif_serve.runtime.admission import MANAGEMENT_IN_FLIGHT, InFlightLimit
from semif_serve.state_key import STATE_KEY_HEADER

access_log = logging.getLogger("semif_serve.access")
CALLER_REQUEST_ID = re.compile(r"[!-~]{1,128}")  # visible ASCII, bounded: safe to echo and log
# Any method: an unsupported one (TRACE /health) then gets its 405 with Allow, not a 401.
PUBLIC_PATHS = frozenset({"/health", "/metrics"})


class InProgress:
    """The requests inside the app now. When the shutdown grace period (SEMIF_GRACEFUL_TIMEOUT_S)
    ends with some still running, the worker calls `cut_off` to log each before it exits."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # requests come and go on the worker's threads
        self._requests: dict[int, falcon.Request] = {}

    def add(self, req: falcon.Request) -> None:
        with self._lock:
            self._requests[id(req)] = req

    def remove(self, req: falcon.Request) -> None:
        with self._lock:
            self._requests.pop(id(req), None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._requests)

    def cut_off(self) -> int:
        """Log one access line (`"error": "cut_off"`, no status) per request still in progress;
        returns how many there were."""
        with self._lock:
            requests = list(self._requests.values())
        for req in requests:
            record = access_record(req, None)
            record["error"] = "cut_off"
            access_log.error(json.dumps(record))
        return len(requests)


def access_record(req: falcon.Request, status: int | None) -> dict:
    return {
        "request_id": req.context.request_id,
        "method": req.method,
        "route": req.uri_template or req.path,
        "status": status,
        "decisions": req.context.get("rows"),
        "duration_ms": round((perf_counter() - req.context.started) * 1000, 3),
    }


class RequestLog:
    """Gives every request an id (the caller's X-Request-Id when sane), logs one JSON line and
    counts it in the metrics; `in_progress` holds each request until its response is ready.
    The one place that adds the per-request reply headers, on successes and errors alike:
    X-Request-Id (also as x-typesafe-request-id), and X-Semif-State-Key when a resource accepted
    the request's state."""

    def __init__(
        self,
        metrics: Metrics | None = None,
        literal_routes: frozenset[str] = frozenset(),
        in_progress: InProgress | None = None,
    ):
        self._metrics = metrics
        self._literal_routes = literal_routes  # label a request refused before routing (401)
        self.in_progress = InProgress() if in_progress is None else in_progress

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        given = req.get_header("X-Request-Id")
        req.context.request_id = (
            given if given and CALLER_REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        )
        req.context.started = perf_counter()
        self.in_progress.add(req)

    def process_response(self, req, resp, resource, req_succeeded) -> None:
        self.in_progress.remove(req)
        resp.set_header("X-Request-Id", req.context.request_id)
        # The same id where the TypeSafe SDK reads it (its responses' and errors' request_id).
        resp.set_header("x-typesafe-request-id", req.context.request_id)
        key = req.context.get("state_key")
        if key is not None:
            resp.set_header(STATE_KEY_HEADER, key)
        record = access_record(req, resp.status_code)
        if req.context.get("error_code"):
            record["error"] = req.context.error_code
        if req.context.get("model"):  # the model that answered (the ecosystem routes)
            record["model"] = req.context.model
            record["revision"] = req.context.get("revision")
        access_log.info(json.dumps(record))
        if self._metrics is not None:
            # Never a raw path as a label: an attacker could create unbounded label values.
            route = req.uri_template or (
                req.path if req.path in self._literal_routes else "unmatched"
            )
            seconds = record["duration_ms"] / 1000
            self._metrics.observe_request(route, resp.status_code, seconds, record.get("error"))


class BearerAuth:
    """Every route except GET /health needs `Authorization: Bearer <token>` (INV-6): the API
    token or, when configured, the admin token; `req.context.admin` says which."""

    def __init__(self, token: str, admin_token: str | None = None):
        self._token = token.encode("ascii")
        self._admin_token = admin_token.encode("ascii") if admin_token else None

    def process_request(self, req: falcon.Request, resp: falcon.Response) -> None:
        if req.path in PUBLIC_PATHS:
            return
        scheme, _, given = (req.get_header("Authorization") or "").partition(" ")
        # Constant-time compares; WSGI headers are latin-1 strings, so any header encodes.
        presented = given.strip().encode("latin-1", "replace")
        is_bearer = scheme.lower() == "bearer"
        is_user = hmac.compare_digest(presented, self._token)
        is_admin = self._admin_token is not None and hmac.compare_digest(
            presented, self._admin_token
        )
        if not is_bearer or not (is_user or is_admin):
            raise Unauthorized("missing or wrong bearer token")
        req.context.admin = is_admin


class Admission:
    """Counts the POSTs and PUTs in progress in their resource's pool (its `admission`:
    "scoring" or "management"); past a pool's limit the next is refused before its body is
    read."""

    def __init__(self, limit: InFlightLimit):
        self.limit = limit
        management = InFlightLimit(MANAGEMENT_IN_FLIGHT, what="management calls")
        self.pools = {"scoring": limit, "management": management}

    def process_resource(self, req, resp, resource, params) -> None:
        pool = self.pools.get(getattr(resource, "admission", None))
        if req.method in ("POST", "PUT") and pool is not None:
            pool.acquire()
            req.context.admitted = pool

    def process_response(self, req, resp, resource, req_succeeded) -> None:
        pool = req.context.pop("admitted", None)
        if pool is not None:  # taken once: a request releases once
            pool.release()

