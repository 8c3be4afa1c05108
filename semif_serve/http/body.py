"""Read a request body as one JSON object, never holding more than the limit (C2, S3).

The declared Content-Length is trusted only when it is plain ASCII digits: Python's int() also
accepts Unicode digits ('١٠'), signs, spaces and underscores. A declared length over the limit
is refused before any byte is read; otherwise the body is read in chunks and the limit is checked
before each chunk is kept, so a chunked upload that never ends costs at most `limit` bytes.
A gzip or zstd body is decoded within the same limit (`encoding`). A parsed body holding a lone
UTF-16 surrogate anywhere is refused, naming where: no reply or prompt could encode that text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
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
from semif_serve.http.encoding import coding, decoded
from semif_serve.http.errors import encodable

CHUNK_BYTES = 64 * 1024
ASCII_DIGITS = re.compile(r"[0-9]+")
# A JSON escape of a UTF-16 surrogate (\uD800-\uDFFF, any case). Strict UTF-8 never decodes
# to a surrogate, so only a body holding such an escape can carry a lone one after parsing.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# Where a value sits, innermost last: (parent path, key or index); None is the body itself.
FieldPath = tuple["FieldPath", str | int] | None


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
    except TimeoutError:  # the server's body deadline (semif_serve/worker/worker.py) passed
        raise RequestTimeout(
            "the body did not arrive within the server's deadline (SEMIF_BODY_TIMEOUT_S)"
        ) from None
    except ParseException as error:
        raise BadRequest(f"malformed chunked body ({type(error).__name__})") from None
    except OSError:  # the peer went away mid-body (gunicorn's NoMoreData, a reset)
        raise IncompleteBody(
            "the body ended before it was complete (the client closed the connection)"
        ) from None


def parse_json_object(body: bytes, unique_keys: bool = False) -> dict[str, Any]:
    """The body as a JSON object; anything else (not UTF-8, not JSON, NaN, an array) is a 422.
    With `unique_keys`, so is an object that names one key twice (JSON parsers keep the last:
    two choices of one name would silently become one)."""
    hook = _unique_object if unique_keys else None
    try:
        value = json.loads(
            body.decode("utf-8"), parse_constant=_reject_constant, object_pairs_hook=hook
        )
    except InvalidRequest:
        raise
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
    if may_hold_lone_surrogate(body):
        refuse_lone_surrogates(value)
    return value


def may_hold_lone_surrogate(body: bytes) -> bool:
    """Whether the raw body escapes a surrogate; a pair (\\ud83d\\ude00) also counts."""
    return SURROGATE_ESCAPE.search(body) is not None


def refuse_lone_surrogates(value: dict[str, Any]) -> None:
    """InvalidRequest naming the first string, object key or value, in document order, that
    holds a lone surrogate. A loop over a stack of iterators, never recursion (a body may nest
    ~1,000 deep); a field's path is spelled out only when it is refused."""
    pending: list[tuple[Iterator[tuple[Any, Any]], FieldPath]] = [(_members(value), None)]
    while pending:
        members, path = pending[-1]
        for segment, child in members:
            if isinstance(segment, str):  # an object key
                _refuse_if_lone_surrogate(segment, path, is_key=True)
            if isinstance(child, str):
                _refuse_if_lone_surrogate(child, (path, segment))
            elif isinstance(child, (dict, list)):
                pending.append((_members(child), (path, segment)))
                break  # the child's members first; this container's rest resumes after them
        else:
            pending.pop()


def _members(container: dict[str, Any] | list[Any]) -> Iterator[tuple[Any, Any]]:
    """(key, value) of an object, (index, item) of an array."""
    return iter(container.items()) if isinstance(container, dict) else enumerate(container)


def _refuse_if_lone_surrogate(text: str, path: FieldPath, is_key: bool = False) -> None:
    """`path`: the field's; for a key, its object's (None: the body itself)."""
    found = LONE_SURROGATE.search(text)
    if found is None:
        return
    escape = f"\\u{ord(found.group()):04x}"
    problem = f"contains a lone surrogate ({escape}), which is not valid Unicode text"
    if is_key:
        shown = encodable(text)
        raise InvalidRequest(f'{_field_name(path) or "body"}: the key "{shown}" {problem}')
    raise InvalidRequest(f"{_field_name(path)}: {problem}")


def _field_name(path: FieldPath) -> str:
    """A path as the service's messages name fields: `options[1].id`, `state.door`."""
    parts = []
    while path is not None:
        path, segment = path
        parts.append(f"[{segment}]" if isinstance(segment, int) else f".{segment}")
    return "".join(reversed(parts)).removeprefix(".")


def _unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    value = dict(pairs)
    if len(value) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                shown = encodable(key)
                raise InvalidRequest(f'body: the key "{shown}" appears twice in one object')
            seen.add(key)
    return value


def read_json_object(
    environ: dict[str, Any], limit: int, unique_keys: bool = False
) -> dict[str, Any]:
    """The body as a JSON object, decoded from its Content-Encoding first: `limit` bounds the
    bytes on the wire and the decoded bytes alike. The coding is checked before any byte is
    read, so an unknown one is a 415 whatever the body."""
    name = coding(environ.get("HTTP_CONTENT_ENCODING"))
    return parse_json_object(decoded(read_body(environ, limit), name, limit), unique_keys)


def _reject_constant(constant: str) -> None:
    raise ValueError(f"{constant} is not valid JSON")
