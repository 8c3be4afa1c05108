"""Model management over HTTP: list (any valid token), register/reconfigure and unload (admin)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import falcon

from semif_serve.apis.names import listed_aliases
from semif_serve.errors import Forbidden, InvalidRequest
from semif_serve.http.body import read_json_object
from semif_serve.http.ecosystem import model_named
from semif_serve.http.resources import send_json
from semif_serve.runtime.registry import Runtime


def require_admin(req: falcon.Request) -> None:
    if not req.context.get("admin"):
        raise Forbidden("model management needs the admin token (SEMIF_ADMIN_TOKEN)")


class _Management:
    # Its POSTs and PUTs count toward MANAGEMENT_IN_FLIGHT (see middleware.Admission): a PUT
    # holds its thread for a whole load, and never one that /health needs.
    admission = "management"

    def __init__(self, runtime: Runtime, max_body_bytes: int):
        self._runtime = runtime
        self._max_body_bytes = max_body_bytes


class Models(_Management):
    """GET and HEAD /v1/models: every registered model's state, the configured aliases and (with
    SEMIF_HOSTED_MODEL_NAMES) the exact hosted names; reserves nothing, resets no timer."""

    def __init__(self, runtime: Runtime, max_body_bytes: int, settings: Any):
        super().__init__(runtime, max_body_bytes)
        self._aliases = settings.model_aliases
        self._hosted = settings.hosted_model_names
        self._started = int(time.time())

    def on_get(self, req: falcon.Request, resp: falcon.Response) -> None:
        send_json(resp, model_listing(self._runtime.status(), self._listed(), self._started))

    def retrieve(self, model_id: str) -> dict[str, Any]:
        """GET /v1/models/{id} (OpenAI's `models.retrieve`): the listing's entry for a name a
        request may send, a hosted name included; 404 model_not_found otherwise."""
        model = model_named(self._runtime, model_id, self._aliases, self._hosted)
        more = {} if model == model_id else {"alias_of": model}
        entry = {"id": model_id, "object": "model", "created": self._started}
        return {**entry, "owned_by": "semif-serve", **more}

    def _listed(self) -> dict[str, str]:
        ids = [status["id"] for status in self._runtime.status()]
        return listed_aliases(self._aliases, self._runtime.default_id, self._hosted, ids)

    on_head = on_get  # Falcon answers a HEAD with the GET's status and headers, no body


def model_listing(
    statuses: list[dict[str, Any]], aliases: Mapping[str, str], started: int
) -> dict[str, Any]:
    """The list both SDKs parse, around today's: `models` is each registered model's status,
    plus the TypeSafe SDK's `name`, `description` and `release_date` (the date this server
    started: it does not know a model's own release) and the `aliases` that name it; `data` is
    OpenAI's list of every name a request can send, each model and alias."""
    date = time.strftime("%Y-%m-%d", time.gmtime(started))
    models = [
        {
            **status,
            "name": status["id"],
            "description": _description(status),
            "release_date": date,
            "aliases": sorted(alias for alias, model in aliases.items() if model == status["id"]),
        }
        for status in statuses
    ]
    names = [(status["id"], {}) for status in statuses]
    names += [(alias, {"alias_of": model}) for alias, model in aliases.items()]
    data = [
        {"id": name, "object": "model", "created": started, "owned_by": "semif-serve", **more}
        for name, more in names
    ]
    return {"object": "list", "data": data, "models": models}


def _description(status: dict[str, Any]) -> str:
    revision = status.get("revision")
    source = str(status.get("source"))
    return f"{source} at revision {revision}" if revision else source


class Model(_Management):
    """GET /v1/models/{id}: one name's entry (`Models.retrieve`); PUT: register a new model or
    reconfigure one (admin), then load it."""

    def __init__(self, runtime: Runtime, max_body_bytes: int, listing: Models):
        super().__init__(runtime, max_body_bytes)
        self._listing = listing

    def on_get(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        send_json(resp, self._listing.retrieve(model_id))

    on_head = on_get  # as every GET route: the GET's status and headers, no body

    def on_put(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        require_admin(req)
        table = read_json_object(req.env, self._max_body_bytes)
        send_json(resp, self._runtime.register(model_id, table))


class ModelUnload(_Management):
    """POST /v1/models/{id}/unload: idempotent; 200 {id, loaded: false}."""

    def on_post(self, req: falcon.Request, resp: falcon.Response, model_id: str) -> None:
        require_admin(req)
        send_json(resp, self._runtime.unload(model_id))


class BulkUnload(_Management):
    """POST /v1/models/unload {"ids": [...]}: 200 {unloaded: [...], not_found: [...]}."""

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        require_admin(req)
        body = read_json_object(req.env, self._max_body_bytes)
        ids = body.get("ids")
        if (
            set(body) != {"ids"}
            or not isinstance(ids, list)
            or not all(isinstance(i, str) for i in ids)
        ):
            raise InvalidRequest('body: must be {"ids": [model id, ...]}')
        send_json(resp, self._runtime.bulk_unload(ids))
