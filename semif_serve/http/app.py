"""`create_app`: the Falcon WSGI app over a `DecisionService`."""

from __future__ import annotations

from typing import Any

import falcon

from semif_serve.http.ecosystem import Decisions, SystemOne
from semif_serve.http.errors import ECOSYSTEM_ROUTES, handle_error
from semif_serve.http.management import BulkUnload, Model, Models, ModelUnload
from semif_serve.http.metrics import Metrics
from semif_serve.http.middleware import Admission, BearerAuth, InProgress, RequestLog
from semif_serve.http.resources import Decide, DecideShared, Health, MetricsPage
from semif_serve.runtime.admission import InFlightLimit
from semif_serve.runtime.service import DecisionService


class ServingApp(falcon.App):
    """falcon.App plus what the gunicorn worker (semif_serve/worker/) reports to: `in_progress`,
    the requests inside it now (it names those its shutdown grace period cuts off), and
    `metrics` (it counts the replies it could not deliver)."""

    __slots__ = ("in_progress", "metrics")


def create_app(
    service: DecisionService, settings: Any, in_flight: InFlightLimit | None = None
) -> ServingApp:
    """The app; `in_flight` defaults to a fresh SEMIF_MAX_QUEUE limit (tests pass their own)."""
    runtime = service.runtime
    admission = Admission(in_flight or InFlightLimit(settings.max_queue))
    admission.limit.estimate = runtime.estimated_wait  # a 429's Retry-After
    metrics = Metrics(runtime.status, lambda: admission.limit.in_flight)
    runtime.listen(metrics.model_event)
    runtime.on_batch = metrics.batch
    auth = BearerAuth(settings.api_token, settings.admin_token)
    literal = frozenset(
        {"/health", "/metrics", "/decide", "/decide/shared", "/v1/models", *ECOSYSTEM_ROUTES}
    )
    in_progress = InProgress()
    app = ServingApp(middleware=[RequestLog(metrics, literal, in_progress), auth, admission])
    app.in_progress = in_progress
    app.metrics = metrics
    limit = settings.max_body_bytes
    app.add_route("/health", Health(service))
    app.add_route("/decide", Decide(service, limit))
    app.add_route("/decide/shared", DecideShared(service, limit))
    app.add_route("/metrics", MetricsPage(metrics))
    app.add_route("/v1/systemone", SystemOne(service, settings))
    app.add_route("/v1/decisions", Decisions(service, settings))
    models = Models(runtime, limit, settings)
    app.add_route("/v1/models", models)
    app.add_route("/v1/models/unload", BulkUnload(runtime, limit))
    app.add_route("/v1/models/{model_id}", Model(runtime, limit, models))
    app.add_route("/v1/models/{model_id}/unload", ModelUnload(runtime, limit))
    app.add_error_handler(Exception, handle_error)
    app.add_error_handler(falcon.HTTPError, handle_error)
    return app
