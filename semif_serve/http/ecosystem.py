"""POST /v1/systemone and POST /v1/decisions: the ecosystem's decision formats, served by the
same `DecisionService` calls as `/decide/shared` (one shared call per SEMIF_MAX_DECISIONS
questions, all over the request's one state).

The request's `model` names a registered model, or an alias the operator configured
(SEMIF_MODEL_ALIASES); a registered id always names itself. The reply names the model that
answered, never the alias. A System One request with image assets (multipart/form-data) is a
422: this server runs text models.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType
from typing import Any

import falcon

from semif_serve.apis import decisions, systemone
from semif_serve.apis.mapping import answered, refuse_image
from semif_serve.errors import ModelNotFound
from semif_serve.http.body import read_body, read_json_object
from semif_serve.http.encoding import coding
from semif_serve.http.environ import CLIENT_GONE_KEY
from semif_serve.http.resources import accepted_state_key, send_json, session_of
from semif_serve.runtime.service import DecisionService


class _Format:
    admitted = True  # counts toward SEMIF_MAX_QUEUE (see middleware.Admission)
    translator: ModuleType
    state_field: str  # how messages name the request field the state comes from

    def __init__(self, service: DecisionService, settings: Any):
        self._service = service
        self._limit = settings.max_body_bytes
        self._per_call = settings.max_decisions
        self._aliases: Mapping[str, str] = settings.model_aliases

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        self._refuse_attachments(req)
        header_session = session_of(req)
        request = self.translator.parse(read_json_object(req.env, self._limit, unique_keys=True))
        session = request.session or header_session  # the body's prompt_cache_key wins
        req.context.state_key = accepted_state_key({"state": request.state})
        model = self._model(request.model)
        gone = req.env.get(CLIENT_GONE_KEY)

        def decide_shared(body: dict[str, Any]) -> dict[str, Any]:
            body = {**body, "model": model}
            return self._service.decide_shared(body, gone, session, request.breakpoints).body

        scored = answered(
            request.state,
            [question.mapped for question in request.questions],
            request.routing,
            self._per_call,
            decide_shared,
            self.state_field,
        )
        req.context.rows = len(request.questions)
        send_json(resp, self.translator.reply(request, scored, model))

    def _refuse_attachments(self, req: falcon.Request) -> None:
        pass

    def _model(self, name: str | None) -> str:
        """The registered model `name` means (None: the default)."""
        runtime = self._service.runtime
        if name is None:
            return runtime.default_id
        for model in (name, self._aliases.get(name)):
            if model is not None and _registered(runtime, model):
                return model
        registered = ", ".join(status["id"] for status in runtime.status())
        aliases = ", ".join(sorted(self._aliases)) or "none configured (SEMIF_MODEL_ALIASES)"
        raise ModelNotFound(
            f"model {name!r} is neither a registered model ({registered}) nor an alias of one "
            f"(aliases: {aliases})"
        )


def _registered(runtime: Any, model: str) -> bool:
    try:
        runtime.entry(model)
    except ModelNotFound:
        return False
    return True


class SystemOne(_Format):
    translator = systemone
    state_field = "state"

    def _refuse_attachments(self, req: falcon.Request) -> None:
        # The SDK sends image assets as multipart/form-data, its JSON in the part `request`.
        if (req.content_type or "").lower().startswith("multipart/"):
            coding(req.get_header("Content-Encoding"))  # an unknown coding is a 415 first
            read_body(req.env, self._limit)  # taken whole, so the connection stays usable
            raise refuse_image("assets")


class Decisions(_Format):
    translator = decisions
    state_field = "input"
