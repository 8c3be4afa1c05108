"""The one place where exceptions become HTTP statuses and the `{error: {code, message}}` body."""

from __future__ import annotations

import json
import logging

import falcon

from semif_serve.errors import (
    BadManagementRequest,
    BadRequest,
    ClientGone,
    Forbidden,
    IncompleteBody,
    InsufficientMemory,
    InvalidRequest,
    ModelLoadFailed,
    ModelNotFound,
    OutOfMemory,
    QueueTimedOut,
    RequestTimeout,
    RequestTooLarge,
    ScoringFailed,
    ServerBusy,
    Unauthorized,
)
from semif_serve.metrics import ABANDONED

log = logging.getLogger(__name__)

STATUS_AND_CODE: dict[type[Exception], tuple[int, str]] = {
    BadRequest: (400, "bad_request"),
    BadManagementRequest: (400, "invalid_request"),
    IncompleteBody: (400, "invalid_request"),
    RequestTimeout: (408, "request_timeout"),
    Forbidden: (403, "forbidden"),
    ModelNotFound: (404, "model_not_found"),
    QueueTimedOut: (503, "server_busy"),
    InsufficientMemory: (503, "insufficient_memory"),
    Unauthorized: (401, "unauthorized"),
    RequestTooLarge: (413, "request_too_large"),
    InvalidRequest: (422, "invalid_request"),
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
EXTRA_HEADERS: dict[type[Exception], dict[str, str]] = {
    Unauthorized: {"WWW-Authenticate": "Bearer"},
    ServerBusy: {"Retry-After": "1"},
    QueueTimedOut: {"Retry-After": "1"},
    InsufficientMemory: {"Retry-After": "5"},
    OutOfMemory: {"Retry-After": "1"},
    ModelLoadFailed: {"Retry-After": "5"},
    # The rest of a half-read body is still on the socket: the connection cannot be reused.
    IncompleteBody: {"Connection": "close"},
    RequestTimeout: {"Connection": "close"},
    # A body refused for its size is not read to its end either (the worker honours this).
    RequestTooLarge: {"Connection": "close"},
}


def envelope(code: str, message: str) -> str:
    """The error body, always encodable as UTF-8: a message character that is not (a lone
    surrogate quoted from a request) is written as its escape, the six characters `\\ud800`."""
    error = {"code": code, "message": encodable(message)}
    return json.dumps({"error": error}, ensure_ascii=False)


def encodable(text: str) -> str:
    """`text` with each character UTF-8 cannot encode replaced by its backslash escape."""
    return text.encode(errors="backslashreplace").decode()


def classify(error: Exception) -> tuple[int, str, str, dict[str, str]]:
    """(status, code, message, headers) for any exception."""
    for kind, (status, code) in STATUS_AND_CODE.items():
        if isinstance(error, kind):
            return status, code, str(error), EXTRA_HEADERS.get(kind, {})
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
    resp.data = envelope(code, message).encode()
    for name, value in headers.items():
        resp.set_header(name, value)
    req.context.error_code = code
