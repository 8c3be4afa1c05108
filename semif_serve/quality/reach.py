"""Whether a server answers at all, asked before a command's first real call.

A command's calls have a long deadline (`--timeout-s`, 600 s by default) within which the client
retries a refused connection, so a command pointed at the wrong port would wait that long before
saying so. `answers` asks `GET /health` (no token needed) once, under `REACH_DEADLINE_S`: a
refused connection (nothing listens there) at once, or no reply by then, and the command stops
with `unreachable(url)`. Any reply counts, an error status included (a proxy's 502, a 401): the
command's own calls then say what is wrong.
"""

from __future__ import annotations

REACH_DEADLINE_S = 3.0


def answers(url: str, deadline_s: float = REACH_DEADLINE_S) -> bool:
    """Whether `GET url/health` gets any HTTP reply within `deadline_s` (a URL without an
    http:// or https:// scheme, or a host name that does not resolve, gets none)."""
    from semif_serve.client import Client, ConnectionFailed, RetryPolicy, SemifError

    try:
        # A first backoff as long as the deadline: a refused connection is not tried again.
        policy = RetryPolicy(deadline_s, initial_backoff_s=deadline_s, max_backoff_s=deadline_s)
        with Client(url, policy=policy) as probe:
            probe.health()
    except ConnectionFailed:
        return False
    except SemifError:  # ApiError, InvalidReply: something at that address answered
        return True
    return True


def unreachable(url: str) -> str:
    """The one line a command prints when `answers(url)` is False."""
    return f"cannot reach {url} (start the server, or pass --url)"
