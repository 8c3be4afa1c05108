"""A small HTTP client for a running semif-serve: bearer token from a file, timeouts, one error.

Every failure (unreachable server, timeout, an error envelope, a reply that is not JSON) is a
`ServiceError` whose message says what happened and where; `status` and `code` are set when the
server answered.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

DEFAULT_TIMEOUT_S = 600.0  # a long CPU decision or a 64-row shared call can take minutes


class ServiceError(Exception):
    def __init__(self, message: str, status: int | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code


def read_token(path: Path) -> str:
    """The bearer token stored in `path` (surrounding whitespace dropped)."""
    try:
        token = path.read_text(encoding="ascii").strip()
    except FileNotFoundError:
        raise ServiceError(f"token file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ServiceError(f"cannot read token file {path}: {error}") from None
    if not token:
        raise ServiceError(f"token file {path} is empty")
    return token


class ServiceClient:
    def __init__(self, url: str, token: str, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.url = url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    def health(self) -> dict[str, Any]:
        return self._request("GET", "/health", None)

    def decide(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/decide", body)

    def decide_shared(self, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", "/decide/shared", body)

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> dict[str, Any]:
        target = self.url + path
        data = None if body is None else json.dumps(body, ensure_ascii=False).encode("utf-8")
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        if path != "/health":
            headers["Authorization"] = f"Bearer {self._token}"
        request = urllib.request.Request(target, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                return _json_reply(response.read(), target)
        except urllib.error.HTTPError as error:
            raise _envelope_error(error, f"{method} {target}") from None
        except TimeoutError:
            raise ServiceError(f"{method} {target}: no reply within {self.timeout_s:g} s") from None
        except urllib.error.URLError as error:
            raise ServiceError(
                f"{method} {target}: cannot reach the server: {error.reason}"
            ) from None
        except OSError as error:
            raise ServiceError(f"{method} {target}: connection failed: {error}") from None


def _json_reply(payload: bytes, target: str) -> dict[str, Any]:
    try:
        reply = json.loads(payload)
    except ValueError:
        raise ServiceError(f"{target}: the reply is not JSON: {payload[:200]!r}") from None
    if not isinstance(reply, dict):
        raise ServiceError(f"{target}: the reply is not a JSON object")
    return reply


def _envelope_error(error: urllib.error.HTTPError, request: str) -> ServiceError:
    """The server's `{error: {code, message}}` as a ServiceError, else the raw reply."""
    payload = error.read()
    try:
        envelope = json.loads(payload)["error"]
        code, message = envelope["code"], envelope["message"]
    except (ValueError, KeyError, TypeError):
        code, message = None, payload[:200].decode("utf-8", "replace")
    return ServiceError(f"{request}: {error.code} {code or ''}: {message}", error.code, code)
