"""What a failed call raises: every exception is a `SemifError`.

- `ApiError`: the server (or a proxy in front of it) answered with an error status; it carries
  the envelope's `code` and `message`, the status, the reply's X-Request-Id and Retry-After.
- `ConnectionFailed`: no reply at all (nothing listening, a dropped connection, no reply in time),
  or too little of the deadline left to send the call.
- `InvalidReply`: a success status whose body is not a JSON object.
"""

from __future__ import annotations


class SemifError(Exception):
    """A call to semif-serve failed; the message says which call and why."""


class ApiError(SemifError):
    """An error reply. `code` and `message` come from the `{"error": {code, message}}` envelope;
    a reply without one (a proxy's HTML page) has `code` None and its text as `message`."""

    def __init__(
        self,
        call: str,
        status: int,
        code: str | None,
        message: str,
        request_id: str | None,
        retry_after_s: float | None = None,
    ):
        self.call = call  # e.g. "POST http://127.0.0.1:8471/decide"
        self.status = status
        self.code = code
        self.message = message
        self.request_id = request_id  # the X-Request-Id to quote in a report
        self.retry_after_s = retry_after_s  # the reply's Retry-After, in seconds
        shown = f"{status} {code}" if code else str(status)
        super().__init__(f"{call}: {shown}: {message} (X-Request-Id: {request_id or 'none'})")


class ConnectionFailed(SemifError):
    """The server sent no reply: it could not be reached, the connection broke, or time ran out
    (during an attempt, or before one could be sent)."""


class InvalidReply(SemifError):
    """The server answered with success, but not with a JSON object."""

    def __init__(self, call: str, status: int, request_id: str | None, detail: str):
        self.call = call
        self.status = status
        self.request_id = request_id
        super().__init__(f"{call}: {status}: {detail} (X-Request-Id: {request_id or 'none'})")
