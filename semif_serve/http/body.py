"""Read a request body as one JSON object, never holding more than the limit (C2, S3).

The declared Content-Length is trusted only when it is plain ASCII digits: Python's int() also
accepts Unicode digits ('١٠'), signs, spaces and underscores. A declared length over the limit
is refused before any byte is read; otherwise the body is read in chunks and the limit is checked
before each chunk is kept, so a chunked upload that never ends costs at most `limit` bytes.
"""

from __future__ import annotations

import json
import re
from typing import IO, Any

# gunicorn's body readers raise this for malformed framing (a chunk size that is not hex, a
# chunk without its CRLF); anything else reading the stream raises OSError or nothing.
from gunicorn.http.errors import ParseException

from semif_serve.errors import (
    BadRequest,
    IncompleteBody,
    InvalidRequest,
    RequestTimeout,
    RequestTooLarge,
)

CHUNK_BYTES = 64 * 1024
ASCII_DIGITS = re.compile(r"[0-9]+")


def declared_length(environ: dict[str, Any]) -> int | None:
    """The Content-Length as an int, None when absent; BadRequest unless it is ASCII digits."""
    text = environ.get("CONTENT_LENGTH")
    if text is None or text == "":
        return None
    if not ASCII_DIGITS.fullmatch(text):
        raise BadRequest(f"Content-Length must be ASCII digits, got {text!r}")
    return int(text)


def read_body(environ: dict[str, Any], limit: int) -> bytes:
    """The whole body, exactly as declared. The server bounds each read by the request's body
    deadline: a read that times out is a 408, and a body that ends before its Content-Length
    (or a chunked body cut off) is a 400, never scored."""
    declared = declared_length(environ)
    if declared is not None and declared > limit:
        raise RequestTooLarge(f"the body declares {declared} bytes, over the limit of {limit}")
    stream: IO[bytes] = environ["wsgi.input"]
    remaining = declared  # None: read to the end (a chunked upload)
    kept: list[bytes] = []
    size = 0
    while remaining is None or remaining > 0:
        # Never ask for more than one byte past the limit: a blocking read(n) waits for n bytes.
        want = min(CHUNK_BYTES, limit - size + 1)
        if remaining is not None:
            want = min(want, remaining)
        chunk = _read_chunk(stream, want)
        if not chunk:
            if remaining is not None:
                raise IncompleteBody(
                    f"the body ended after {size} of its declared {declared} bytes"
                )
            break
        if size + len(chunk) > limit:
            raise RequestTooLarge(f"the body is over the limit of {limit} bytes")
        kept.append(chunk)
        size += len(chunk)
        if remaining is not None:
            remaining -= len(chunk)
    return b"".join(kept)


def _read_chunk(stream: IO[bytes], want: int) -> bytes:
    try:
        return stream.read(want)
    except TimeoutError:  # the server's body deadline (semif_serve/worker.py) passed
        raise RequestTimeout(
            "the body did not arrive within the server's deadline (SEMIF_BODY_TIMEOUT_S)"
        ) from None
    except ParseException as error:
        raise BadRequest(f"malformed chunked body ({type(error).__name__})") from None
    except OSError:  # the peer went away mid-body (gunicorn's NoMoreData, a reset)
        raise IncompleteBody(
            "the body ended before it was complete (the client closed the connection)"
        ) from None


def parse_json_object(body: bytes) -> dict[str, Any]:
    """The body as a JSON object; anything else (not UTF-8, not JSON, NaN, an array) is a 422."""
    try:
        value = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except UnicodeDecodeError:
        raise InvalidRequest("body: must be UTF-8 encoded JSON") from None
    except ValueError as error:
        raise InvalidRequest(f"body: not valid JSON: {error}") from None
    except RecursionError:
        # The C parser counts its nesting against the interpreter's recursion limit (~1,000
        # levels, less the caller's frames); past it the body is refused, never a 500. Values
        # that may legitimately nest (`state`) have a lower, documented limit of their own.
        raise InvalidRequest("body: JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise InvalidRequest(f"body: must be a JSON object, got {type(value).__name__}")
    return value


def read_json_object(environ: dict[str, Any], limit: int) -> dict[str, Any]:
    return parse_json_object(read_body(environ, limit))


def _reject_constant(constant: str) -> None:
    raise ValueError(f"{constant} is not valid JSON")
