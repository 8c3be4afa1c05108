"""POST /v1/systemone and POST /v1/decisions: the ecosystem's decision formats, served by the
same `DecisionService` calls as `/decide/shared` (one shared call per SEMIF_MAX_DECISIONS
questions, all over the request's one state).

The request's `model` names a registered model, an alias the operator configured
(SEMIF_MODEL_ALIASES), or a hosted service's name (`apis.names`: the default model, unless
SEMIF_HOSTED_MODEL_NAMES=0); a registered id always names itself. The reply's `model` echoes the
name asked for, as the hosted services echo their aliases; the model that answered is in the
`x-semif-model` header (`id; revision="..."`), in each answer's `x_semif.model` and in the access
log. Top-level fields the format does not name are ignored and listed in `x-semif-ignored-fields`.
A request's calls all run under the model configuration its first one ran under: a `PUT` that
changes it between two of them fails the request whole (503 `configuration_changed`). The
state may be empty (`""`, `{}`, `[]`). A System One request with image assets
(multipart/form-data) is a 422: this server runs text models.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from functools import partial
from types import ModuleType
from typing import Any

import falcon

from semif_serve.apis import decisions, names, systemone
from semif_serve.apis.mapping import (
    EXTENSION,
    LEGACY_EXTENSION,
    answered,
    ignored_keys,
    refuse_image,
)
from semif_serve.errors import ModelNotFound
from semif_serve.http.body import read_body, read_json_object
from semif_serve.http.encoding import coding
from semif_serve.http.environ import CLIENT_GONE_KEY
from semif_serve.http.resources import accepted_state_key, patience_of, send_json, session_of
from semif_serve.runtime.pinning import Pinned
from semif_serve.runtime.service import DecisionService

MODEL_HEADER = "x-semif-model"
IGNORED_HEADER = "x-semif-ignored-fields"
IGNORED_SHOWN = 16  # names the header lists at most (a body may hold thousands)
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.$@-]{1,64}")


class _Format:
    admission = "scoring"  # counts toward SEMIF_MAX_QUEUE (see middleware.Admission)
    translator: ModuleType
    state_field: str  # how messages name the request field the state comes from

    def __init__(self, service: DecisionService, settings: Any):
        self._service = service
        self._limit = settings.max_body_bytes
        self._per_call = settings.max_decisions
        self._aliases: Mapping[str, str] = settings.model_aliases
        self._hosted_names = settings.hosted_model_names
        self._max_options = settings.max_options
        self._legacy_block = settings.legacy_extension_block

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        arrived = time.monotonic()  # the request's one deadline counts from here, in every call
        self._refuse_attachments(req)
        header_session = session_of(req)
        body = read_json_object(req.env, self._limit, unique_keys=True)
        ignored = ignored_keys(body, self.translator.REQUEST_KEYS)
        if ignored:  # said on a refusal too: a misspelt field may be why
            resp.set_header(IGNORED_HEADER, ignored_header(ignored))
        request = self.translator.parse(body, self._max_options)
        session = request.session or header_session  # the body's prompt_cache_key wins
        req.context.state_key = accepted_state_key({"state": request.state}, empty_state=True)
        model = self._model(request.model)
        req.context.model = model
        gone = req.env.get(CLIENT_GONE_KEY)
        patience = patience_of(req)
        pinned = Pinned()  # every call answered by the configuration the first one ran under

        def decide_shared(body: dict[str, Any]) -> dict[str, Any]:
            body = {**body, "model": model}
            return self._service.decide_shared(
                body,
                gone,
                session,
                request.breakpoints,
                empty_state=True,
                patience_s=patience,
                arrived=arrived,
                pinned=pinned,
            ).body

        scored = answered(
            request.state,
            [question.mapped for question in request.questions],
            request.routing,
            self._per_call,
            decide_shared,
            self.state_field,
        )
        req.context.rows = len(request.questions)
        revision = scored.results[0]["model"].get("revision")
        req.context.revision = revision
        resp.set_header(MODEL_HEADER, model_header(model, revision))
        reply = self.translator.reply(request, scored, request.model or model)
        if self._legacy_block:
            with_legacy_blocks(reply["answers"])
        send_json(resp, reply)

    def _refuse_attachments(self, req: falcon.Request) -> None:
        pass

    def _model(self, name: str | None) -> str:
        """The registered model `name` means (None: the default)."""
        runtime = self._service.runtime
        if name is None:
            return runtime.default_id
        return model_named(runtime, name, self._aliases, self._hosted_names)


def model_named(runtime: Any, name: str, aliases: Mapping[str, str], hosted: bool) -> str:
    """The registered model `name` means (`names.resolve`); ModelNotFound listing the models,
    the aliases and the hosted names otherwise."""
    model = names.resolve(name, partial(registered, runtime), runtime.default_id, aliases, hosted)
    if model is not None:
        return model
    known = ", ".join(status["id"] for status in runtime.status())
    listed = ", ".join(sorted(aliases)) or "none configured (SEMIF_MODEL_ALIASES)"
    shown = names.SHOWN if hosted else "off (SEMIF_HOSTED_MODEL_NAMES=0)"
    raise ModelNotFound(
        f"model {name!r} is neither a registered model ({known}) nor an alias of one "
        f"(aliases: {listed}; hosted names: {shown})"
    )


def model_header(model: str, revision: str | None) -> str:
    """`id; revision="..."`: the model that answered (a revision's `"` and `\\` escaped, any
    character outside visible ASCII as `?`, so the value is always a legal header)."""
    if revision is None:
        return model
    shown = "".join(char if " " <= char <= "~" else "?" for char in revision)
    quoted = shown.replace("\\", "\\\\").replace('"', '\\"')
    return f'{model}; revision="{quoted}"'


def ignored_header(keys: tuple[str, ...]) -> str:
    """The ignored top-level fields, comma-separated: a plain name as it is, any other as its
    JSON string (ASCII); at most IGNORED_SHOWN, then how many more."""
    shown = [
        key if PLAIN_NAME.fullmatch(key) else json.dumps(key[:64]) for key in keys[:IGNORED_SHOWN]
    ]
    if len(keys) > IGNORED_SHOWN:
        shown.append(f"... ({len(keys) - IGNORED_SHOWN} more)")
    return ", ".join(shown)


def with_legacy_blocks(answers: Any) -> None:
    """Each answer's extension block also under its old name (SEMIF_LEGACY_EXTENSION_BLOCK)."""
    for answer in answers.values() if isinstance(answers, dict) else answers:
        answer[LEGACY_EXTENSION] = answer[EXTENSION]


def registered(runtime: Any, model: str) -> bool:
    """Whether `model` is a registered model's id."""
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
