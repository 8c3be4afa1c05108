"""The caller's session: the name under which a growing state's versions are routed and cached.

An agent whose state grows (a log it appends to) names its session in `X-Semif-Session` (any
scoring route) or, on `/v1/decisions`, in `prompt_cache_key` (the body's wins when both are
sent). Routers hash on the header ahead of `X-Semif-State-Key`, so every version of the state
reaches one replica (deploy/nginx/semif.conf); there its stored state prefixes are reused only
by calls of the same session, and calls without one share only theirs
(`scoring.prefix_cache`). A session is 1 to MAX_SESSION_LENGTH characters, in the header
visible ASCII only (a header value); it is a cache partition, never text for the model. Pure
Python: the HTTP layer, the ecosystem translators and `semif_serve.client` import it.
"""

from __future__ import annotations

from semif_serve.errors import InvalidRequest

SESSION_HEADER = "X-Semif-Session"
MAX_SESSION_LENGTH = 1024


def parse_session(value: object, where: str = SESSION_HEADER, *, header: bool = True) -> str | None:
    """`value` as a session (None: none named); InvalidRequest naming `where` otherwise. A
    header's value is visible ASCII; a body's (`prompt_cache_key`, header=False) any text."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{where}: must be a string")
    if not 1 <= len(value) <= MAX_SESSION_LENGTH:
        raise InvalidRequest(
            f"{where}: must be 1 to {MAX_SESSION_LENGTH} characters, got {len(value)}"
        )
    if header and any(not 33 <= ord(char) <= 126 for char in value):
        raise InvalidRequest(f"{where}: only visible ASCII characters (33-126) are allowed")
    return value
