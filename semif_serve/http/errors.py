"""The one place where exceptions become HTTP statuses and the `{error: {code, message}}` body.

On the ecosystem's routes the body also carries what their SDKs and the conformance suite
(jevcompat) read: OpenAI's `type` and `param` inside `error`, and the hosted System One service's
`detail` beside it: for a 422 a list of `{loc: ["body", ...field path], msg, type}`, for any
other status `{error_type, message}`.
"""

from __future__ import annotations

import json
import logging
import math
import re
from typing import Any

import falcon

from semif_serve.apis.fields import Field, segments
from semif_serve.errors import (
    BadManagementRequest,
    BadRequest,
    ClientGone,
    ConfigurationChanged,
    Forbidden,
    IncompleteBody,
    InsufficientMemory,
    InvalidRequest,
    ModelLoadFailed,
    ModelNotFound,
    OptionCountUnsupported,
    OutOfMemory,
    Overloaded,
    QueueTimedOut,
    RequestTimeout,
    RequestTooLarge,
    ScoringFailed,
    ServerBusy,
    ServerStarting,
    Unauthorized,
    UnsupportedEncoding,
)
from semif_serve.http.metrics import ABANDONED
from semif_serve.runtime.pace import retry_after_s

log = logging.getLogger(__name__)

STATUS_AND_CODE: dict[type[Exception], tuple[int, str]] = {
    BadRequest: (400, "bad_request"),
    BadManagementRequest: (400, "invalid_request"),
    IncompleteBody: (400, "invalid_request"),
    RequestTimeout: (408, "request_timeout"),
    Forbidden: (403, "forbidden"),
    ModelNotFound: (404, "model_not_found"),
    QueueTimedOut: (503, "server_busy"),
    ServerStarting: (503, "server_busy"),
    ConfigurationChanged: (503, "configuration_changed"),
    InsufficientMemory: (503, "insufficient_memory"),
    Unauthorized: (401, "unauthorized"),
    RequestTooLarge: (413, "request_too_large"),
    OptionCountUnsupported: (422, "option_count_unsupported"),  # before its base class
    InvalidRequest: (422, "invalid_request"),
    UnsupportedEncoding: (415, "unsupported_media_type"),
    ServerBusy: (429, "busy"),
    OutOfMemory: (503, "out_of_memory"),
    ModelLoadFailed: (503, "model_load_failed"),
    ScoringFailed: (500, "scoring_failed"),
    ClientGone: (499, ABANDONED),  # nginx's 499; nobody receives it, /metrics counts it
}
FALCON_CODES = {
    400: "bad_request",
    404: "not_found",
    405: "method_not_allowed",
    411: "length_required",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def retry_headers(seconds: float) -> dict[str, str]:
    """Retry-After (whole seconds, rounded up: never sooner than estimated) and retry-after-ms."""
    return {"Retry-After": str(math.ceil(seconds)), "retry-after-ms": str(round(seconds * 1000))}


# Seconds a refused caller should wait, sent both as Retry-After and as retry-after-ms (the
# TypeSafe and OpenAI SDKs read the second first, to the millisecond). A 429 or 503 for load
# (`Overloaded`) says the model's estimated wait instead, within [1 s, 60 s] (`runtime.pace`).
RETRY_AFTER_S = {
    ServerStarting: 1,
    ConfigurationChanged: 1,
    InsufficientMemory: 5,
    OutOfMemory: 1,
    ModelLoadFailed: 5,
}
EXTRA_HEADERS: dict[type[Exception], dict[str, str]] = {
    Unauthorized: {"WWW-Authenticate": "Bearer"},
    **{kind: retry_headers(seconds) for kind, seconds in RETRY_AFTER_S.items()},
    # The rest of a half-read body is still on the socket: the connection cannot be reused.
    IncompleteBody: {"Connection": "close"},
    RequestTimeout: {"Connection": "close"},
    # A body refused for its size is not read to its end either (the worker honours this).
    RequestTooLarge: {"Connection": "close"},
}


# The ecosystem's routes (http/ecosystem.py): their errors also carry OpenAI's `type` and
# `param`, so the SDKs and gateways built for those APIs read them as they read the originals.
ECOSYSTEM_ROUTES = frozenset({"/v1/systemone", "/v1/decisions"})
ERROR_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    429: "rate_limit_error",
}
FIELD_PREFIX = re.compile(r"([^:\s][^:]*): ")


def envelope(
    code: str, message: str, extra: dict[str, str | None] | None = None, detail: Any = None
) -> str:
    """The error body, always encodable as UTF-8: a message character that is not (a lone
    surrogate quoted from a request) is written as its escape, the six characters `\\ud800`."""
    error = {"code": code, "message": encodable(message), **(extra or {})}
    body: dict[str, Any] = {"error": error}
    if detail is not None:
        body["detail"] = detail
    return json.dumps(body, ensure_ascii=False)


def named_field(message: str, error: Exception) -> Field | None:
    """The field an invalid request names: the segments its raiser gave (the translators:
    a question name or a label holding `:`, `.` or `[` is one segment, as sent), else the
    message's first words (the server's own plain field names); None: no field (`body`)."""
    if not isinstance(error, InvalidRequest):
        return None
    if error.field:
        return Field(*error.field)
    found = FIELD_PREFIX.match(message)
    if found is None or found.group(1) == "body":
        return None
    return Field(*segments(found.group(1)))


def hosted_detail(status: int, code: str, message: str, error: Exception) -> Any:
    """System One's `detail`: a 422's field path (`questions.tone.criteria[2]` → `["body",
    "questions", "tone", "criteria", 2]`, each name as sent) and message; any other error's
    type and message."""
    message = encodable(message)
    if status != 422:
        return {"error_type": error_type(status), "message": message}
    path: list[str | int] = ["body"]
    field = named_field(message, error)
    if field is not None:
        path += [encodable(step) if isinstance(step, str) else step for step in field.path]
        message = message.removeprefix(f"{encodable(field)}: ")
    return [{"loc": path, "msg": message, "type": code}]


def openai_fields(status: int, message: str, error: Exception) -> dict[str, str | None]:
    """`type` by status, and `param`: the field an invalid request names (`named_field`)."""
    field = named_field(message, error)
    return {"type": error_type(status), "param": None if field is None else encodable(field)}


def error_type(status: int) -> str:
    """OpenAI's error `type` for a status."""
    return ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")


def encodable(text: str) -> str:
    """`text` with each character UTF-8 cannot encode replaced by its backslash escape."""
    return text.encode(errors="backslashreplace").decode()


def classify(error: Exception) -> tuple[int, str, str, dict[str, str]]:
    """(status, code, message, headers) for any exception."""
    for kind, (status, code) in STATUS_AND_CODE.items():
        if isinstance(error, kind):
            headers = EXTRA_HEADERS.get(kind, {})
            if isinstance(error, Overloaded):
                headers = retry_headers(retry_after_s(error.retry_after_s))
            return status, code, str(error), headers
    if isinstance(error, falcon.HTTPError):
        status = error.status_code
        message = error.description or error.title or "request failed"
        return status, FALCON_CODES.get(status, "http_error"), message, dict(error.headers or {})
    log.error("unhandled error while serving a request", exc_info=error)
    return 500, "scoring_failed", f"internal error: {type(error).__name__}", {}


def handle_error(req: falcon.Request, resp: falcon.Response, error: Exception, params) -> None:
    """Falcon error handler for every exception: always the JSON envelope."""
    status, code, message, headers = classify(error)
    if status == 404 and isinstance(error, falcon.HTTPError):
        message = f"no such endpoint: {req.method} {req.path}"
    elif status == 405 and isinstance(error, falcon.HTTPError):
        message = f"{req.method} is not allowed on {req.path}"
    resp.status = status
    resp.content_type = falcon.MEDIA_JSON
    extra = detail = None
    if req.path in ECOSYSTEM_ROUTES:
        extra = openai_fields(status, message, error)
        detail = hosted_detail(status, code, message, error)
    resp.data = envelope(code, message, extra, detail).encode()
    for name, value in headers.items():
        resp.set_header(name, value)
    req.context.error_code = code
